"""Paged attention in plain torch ops: the default of a freshly built model on any device.

The CPU executor's attention (backends/cpu/attention.py) puts the C kernel in front of it where the
kernel takes the shapes; a compiled or traced decode bucket runs these ops.

How it keeps stale slots out (models/attention.py, the NOTE on stale slots): the decode path selects
them out of the scores and the values (a zero probability is not enough, 0 * NaN is NaN), and the
prefill path slices the context to `seq_len` before attending.

A decode-only step (one query per sequence) runs as one batched GQA matmul with an fp32 softmax
(bf16 SDPA on CPU is several times slower for single queries); a step with any prefill loops over
its sequences with fp32 SDPA and a causal mask offset by the cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.decoder.models.attention import AttentionMetadata, PagedAttention


class TorchPagedAttention(PagedAttention):
    """Torch ops only."""

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return decode_attention(q, kv_cache, attn, scale)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return prefill_attention(q, kv_cache, attn, scale, k, v)


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    # q: [num_seqs, num_heads, head_dim], one query per sequence.
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    # Gathering through a head-major view lands the context as [kv_heads, seqs, ctx_len, head_dim]:
    # the matmuls below then read it in place, where a [seqs, ctx_len, kv_heads, ...] gather would need
    # a second, transposing copy (2x slower in all at batch 32).
    by_head = kv_cache.permute(0, 3, 1, 2, 4)  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    context = by_head.index_select(2, attn.block_tables.flatten())  # [2, kv, seqs * max_blocks, bs, hd]
    context = context.view(2, num_kv_heads, num_seqs, -1, head_dim)  # [2, kv, num_seqs, ctx_len, hd]
    # GQA without repeating keys: the query heads sharing a KV head are the rows of one matmul.
    q = q.view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)  # [kv, num_seqs, group, hd]
    scores = torch.matmul(q, context[0].transpose(-1, -2)).float() * scale  # [kv, num_seqs, group, ctx_len]
    ctx_len = scores.shape[-1]
    is_past_end = torch.arange(ctx_len, device=q.device)[None, :] >= attn.seq_lens_t[:, None]  # [seqs, ctx]
    scores = scores.masked_fill(is_past_end[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(context.dtype)  # [kv, num_seqs, group, ctx_len]
    # `context` is this step's own gathered copy, so the stale values are zeroed in place (a select,
    # never a product with the mask): one pass over the values instead of a second copy.
    values = context[1].masked_fill_(is_past_end[None, :, :, None], 0)  # [kv, num_seqs, ctx_len, hd]
    out = torch.matmul(probs, values)  # [kv, num_seqs, group, head_dim]
    return out.transpose(0, 1).reshape(num_seqs, num_heads * head_dim)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; the loop bounds and slices come from the host lists.
    # A sequence with no cached prefix (query_len == seq_len) attends to this step's own keys, so
    # nothing is read back from the cache, and a run of such sequences of one length is one batched
    # call: a prefill of many equal prompts costs one SDPA per layer, not one per sequence.
    num_heads, head_dim = q.shape[1], q.shape[2]
    outs = []
    start = 0
    i = 0
    query_lens, seq_lens = attn.query_lens, attn.seq_lens
    while i < len(query_lens):
        query_len, seq_len = query_lens[i], seq_lens[i]
        if query_len == seq_len:
            run = 1
            while i + run < len(query_lens) and query_lens[i + run] == seq_lens[i + run] == query_len:
                run += 1
            end = start + run * query_len
            q_run = q[start:end].view(run, query_len, num_heads, head_dim).transpose(1, 2).float()
            k_run = k[start:end].view(run, query_len, -1, head_dim).transpose(1, 2).float()
            v_run = v[start:end].view(run, query_len, -1, head_dim).transpose(1, 2).float()
            o = F.scaled_dot_product_attention(
                q_run, k_run, v_run, is_causal=True, scale=scale, enable_gqa=True
            )
            outs.append(o.transpose(1, 2).reshape(run * query_len, num_heads * head_dim))
        else:
            run, end = 1, start + query_len
            outs.append(_attend_with_cached_prefix(q[start:end], kv_cache, attn, i, scale))
        start = end
        i += run
    return torch.cat(outs).to(q.dtype)  # [sum(query_lens), num_heads * head_dim]


def _attend_with_cached_prefix(
    q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, i: int, scale: float
) -> torch.Tensor:
    """Sequence i's queries [query_len, num_heads, head_dim] against its whole context in the cache."""
    query_len, seq_len = attn.query_lens[i], attn.seq_lens[i]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_blocks = -(-seq_len // block_size)
    context = kv_cache.index_select(1, attn.block_tables[i, :num_blocks])  # [2, num_blocks, bs, kv, hd]
    # Cut to seq_len before attending: the slots after it are stale (see the NOTE at the top).
    context = context.view(2, -1, num_kv_heads, head_dim)[:, :seq_len]  # [2, seq_len, kv, hd]
    # 4-D inputs: with 3-D ones CPU SDPA falls back to its 3x slower math kernel.
    q_i = q[None].transpose(1, 2).float()  # [1, num_heads, query_len, head_dim]
    k_i = context[None, 0].transpose(1, 2).float()  # [1, num_kv_heads, seq_len, head_dim]
    v_i = context[None, 1].transpose(1, 2).float()  # [1, num_kv_heads, seq_len, head_dim]
    # Query j sits at position seq_len - query_len + j and sees keys up to that position.
    is_visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - query_len)
    o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=is_visible, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(query_len, num_heads * head_dim)  # [query_len, heads * hd]
