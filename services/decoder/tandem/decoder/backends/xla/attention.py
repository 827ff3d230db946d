"""The XLA backend's attention: paged attention whose every bound and mask comes from device tensors.

NOTE: why not the torch ops' prefill. `torch_attention.prefill_attention` loops over the host lists
`query_lens` and `seq_lens`, so a graph traced from it would bake one batch's lengths in as constants
and every new mix of prompts would compile again. Here a prefill step is one masked attention over
the step's whole bucket: each query finds its sequence and position from `query_start_loc` and
`seq_lens_t`, each key its sequence and position from where it sits in the gathered block tables,
and a query sees a key of its own sequence at or before its own position. One graph per bucket
(tokens x sequences x block-table width) then serves every mix the scheduler produces.

Its cost is tokens x sequences x width: the XLA runner runs prefill chunks one sequence at a time
(engine/step/xla_runner.py), so a bucket holds one sequence, and its padding positions none.

Stale slots (models/attention.py): keys past a sequence's end are selected out of the scores (a
select, not a product, so a NaN there never reaches the output) and their values zeroed the same way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.decoder.models.attention import AttentionMetadata, PagedAttention
from tandem.decoder.models.torch_attention import decode_attention


class HeadSharding(Protocol):
    """What the attention needs of the sharding plan (sharding.py): annotate a tensor split by heads."""

    def head_split(self, tensor: torch.Tensor, dim: int) -> None: ...


class XlaPagedAttention(PagedAttention):
    """Decode: the torch ops' batched decode (it reads only tensors). Prefill: one masked bucket.

    With several devices (sharding.py) the queries and the output are annotated split over heads,
    so each device attends with its own KV heads.
    """

    def __init__(self, sharding: HeadSharding | None = None) -> None:
        self.sharding = sharding

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Every padded position goes through, so no shape depends on how many are real: a decode
        bucket's rows are all sequences (padding ones included), and a prefill bucket's positions past
        its sequences attend to nothing and come out zero. Which graph this is follows from the
        shapes alone (a decode bucket has one position per sequence), not from the lengths: a
        one-position prompt chunk runs in a prefill bucket."""
        if self.sharding is not None:
            self.sharding.head_split(q, dim=1)
        if q.shape[0] == attn.block_tables.shape[0]:
            out = self.decode(q, kv_cache, attn, scale)
        else:
            out = self.prefill(q, q, q, kv_cache, attn, scale)  # this step's keys are read from the cache
        if self.sharding is not None:
            self.sharding.head_split(out, dim=1)
        return out

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
        if attn.query_start_loc is None:
            raise ValueError("XLA prefill attention needs attn.query_start_loc")
        return masked_prefill_attention(
            q, kv_cache, attn.query_start_loc, attn.seq_lens_t, attn.block_tables, scale
        )


def masked_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's keys written
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs] context length of each sequence after this step
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] in q's dtype
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, width = block_tables.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    context_len = width * block_size  # key slots per sequence
    device = q.device

    # Each query's sequence and position. Tokens past the last sequence (padding for a sequence-
    # parallel split) get sequence num_seqs, which no key has: they see nothing and give zeros.
    token = torch.arange(num_tokens, device=device)  # [num_tokens]
    seq_of = (token[:, None] >= query_start_loc[None, 1:]).sum(dim=1)  # [num_tokens] in [0, num_seqs]
    seq_index = seq_of.clamp(max=num_seqs - 1)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_seqs]
    first_position = seq_lens - query_lens  # [num_seqs] position of each sequence's first query
    position = first_position[seq_index] + token - query_start_loc[seq_index]  # [num_tokens]

    # Every sequence's key slots side by side, head-major: [2, kv, num_seqs * context_len, head_dim].
    by_head = kv_cache.permute(0, 3, 1, 2, 4)  # [2, kv, num_blocks, block_size, head_dim]
    context = by_head.index_select(2, block_tables.flatten().long())
    context = context.reshape(2, num_kv_heads, num_seqs * context_len, head_dim)
    slot = torch.arange(num_seqs * context_len, device=device)  # [num_seqs * context_len]
    key_seq, key_position = slot // context_len, slot % context_len
    is_live = key_position < seq_lens[key_seq]  # [num_seqs * context_len] inside its sequence
    visible = (key_seq[None, :] == seq_of[:, None]) & (key_position[None, :] <= position[:, None])
    visible = visible & is_live[None, :]  # [num_tokens, num_seqs * context_len]

    # GQA without repeating keys: the query heads sharing a KV head are rows of one matmul. In fp32,
    # as the torch ops' prefill runs its SDPA.
    group = num_heads // num_kv_heads
    q_grouped = q.float().view(num_tokens, num_kv_heads, group, head_dim).transpose(0, 1)  # [kv, T, g, hd]
    keys = context[0].float()  # [kv, S * ctx, hd]
    scores = torch.matmul(q_grouped.reshape(num_kv_heads, -1, head_dim), keys.transpose(1, 2)) * scale
    scores = scores.view(num_kv_heads, num_tokens, group, -1)  # [kv, T, g, S * ctx]
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    # A query with no visible key (padding past the last sequence) would be NaN: give it one zero.
    has_key = visible.any(dim=1)  # [num_tokens]
    scores = scores.masked_fill(~has_key[None, :, None, None], 0.0)
    probs = torch.softmax(scores, dim=-1)  # [kv, T, g, S * ctx]
    values = context[1].float().masked_fill(~is_live[None, :, None], 0.0)  # [kv, S * ctx, hd]
    out = torch.matmul(probs.reshape(num_kv_heads, -1, probs.shape[-1]), values)  # [kv, T * g, hd]
    out = out.view(num_kv_heads, num_tokens, group, head_dim).masked_fill(~has_key[None, :, None, None], 0.0)
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim).to(q.dtype)
