"""The CPU implementation of paged attention: torch ops, and the C decode kernel when it is loaded.

It is also the default of a freshly built model on any device (plain torch ops run everywhere), and
what a compiled or traced decode bucket runs (the C kernel is a ctypes call no graph can hold).

How it keeps stale slots out (models/attention.py, the NOTE on stale slots): the decode path selects
them out of the scores and the values (a zero probability is not enough, 0 * NaN is NaN), the prefill
path slices the context to `seq_len` before attending, and the C kernel reads positions below
`seq_len` only.

Two paths: a decode-only step (one query per sequence) runs as one batched GQA matmul with an fp32
softmax (bf16 SDPA on CPU is several times slower for single queries), or the C kernel, which reads
the paged cache in place; a step with any prefill loops over its sequences with fp32 SDPA and a
causal mask offset by the cached prefix, or, when every context is short, runs through the same C
kernel with one query row per token (see NATIVE_PREFILL_MAX_CONTEXT).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.decoder.models.attention import AttentionMetadata, PagedAttention
from services.decoder.models.native import NativeKernels

# Longest context for which a step with prefill attends through the C decode kernel, one row per
# token: its rows of one sequence are runs of consecutive positions that read each key block once, so
# it costs rows x context where SDPA tiles the causal triangle. Measured on SmolLM2's shapes (30
# layers, 2 threads): 195 tokens 19 ms against 42 for SDPA, 512 tokens 122 against 227, 768 tokens
# 359 against 351. The rows then get the bits a decode step gives the same position, too.
NATIVE_PREFILL_MAX_CONTEXT = 640


class TorchPagedAttention(PagedAttention):
    """Torch ops; with `native`, a decode-only step the kernel takes, and a step with prefill whose
    contexts are all short, run in native_kernels.c instead."""

    def __init__(self, native: NativeKernels | None = None) -> None:
        self.native = native
        # The last step's rows as sequences, computed by its first layer for all of them (one instance
        # serves every layer): (metadata, tables, lengths).
        self._rows: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if self.native is not None and self.native.supports_decode(q, kv_cache):
            return self.native.decode_attention(q, kv_cache, attn.block_tables, attn.seq_lens_t, scale)
        return _decode_attention(q, kv_cache, attn, scale)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # Every context within its table too: a static-shape padding sequence is longer than its
        # one-block table (it attends only to its own fresh keys, which SDPA needs no table for).
        longest = max(attn.seq_lens)
        if (
            self.native is not None
            and longest <= NATIVE_PREFILL_MAX_CONTEXT
            and longest <= attn.block_tables.shape[1] * kv_cache.shape[2]
            and self.native.supports_decode(q, kv_cache)
        ):
            rows = self._rows
            if rows is None or rows[0] is not attn:
                rows = self._rows = (attn, *_rows_as_sequences(attn))
            _, tables, row_lens = rows
            return self.native.decode_attention(q, kv_cache, tables, row_lens, scale)
        return _prefill_attention(q, kv_cache, attn, scale, k, v)


def _rows_as_sequences(attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row of the step as a one-query sequence: its sequence's block table, and the
    context it sees (query j of a sequence sits at position seq_len - query_len + j, and sees it).

    Returns int32 [num_rows, max_blocks] and int32 [num_rows]."""
    device = attn.block_tables.device
    counts = torch.tensor(attn.query_lens, device=device)  # [num_seqs]
    num_rows = sum(attn.query_lens)
    first = attn.seq_lens_t.long() - counts + 1  # [num_seqs] the context of each sequence's first row
    offsets = torch.arange(num_rows, device=device) - torch.repeat_interleave(
        counts.cumsum(0) - counts, counts, output_size=num_rows
    )  # [num_rows] j within its sequence
    row_lens = torch.repeat_interleave(first, counts, output_size=num_rows) + offsets
    tables = attn.block_tables.repeat_interleave(counts, dim=0, output_size=num_rows)
    return tables, row_lens.to(torch.int32)


def _decode_attention(
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


def _prefill_attention(
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
