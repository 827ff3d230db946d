"""The XLA backend's attention reads no host list, and gives what the torch ops' paged attention gives.

It runs on plain CPU tensors too, which is how these tests compare it (the graphs it becomes on an XLA
device are checked in tests/xla/).
"""

from __future__ import annotations

import torch

from tandem.decoder.backends.xla.attention import XlaPagedAttention, masked_prefill_attention
from tandem.decoder.models.attention import AttentionMetadata, write_kv_cache
from tandem.decoder.models.torch_attention import prefill_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 40


def _step(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], num_padding: int = 0):
    """A packed step over a cache whose unused slots hold NaN (stale slots must never reach the output),
    its keys and values written; `num_padding` positions past every sequence write the null block."""
    torch.manual_seed(0)
    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    for table, seq_len, query_len in zip(tables, seq_lens, query_lens, strict=True):
        for p in range(seq_len - query_len):  # the cached prefix
            cache[:, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for table, seq_len, query_len in zip(tables, seq_lens, query_lens, strict=True)
        for p in range(seq_len - query_len, seq_len)
    ] + [0] * num_padding
    num_tokens = len(slots)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM), torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    write_kv_cache(cache, k, v, torch.tensor(slots))
    width = max(len(t) for t in tables)
    attn = AttentionMetadata(
        query_lens=query_lens,
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.tensor([0]),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
    )
    return q, k, v, cache, attn


def test_a_prefill_with_a_cached_prefix_beside_a_fresh_prompt_matches_the_torch_ops() -> None:
    q, k, v, cache, attn = _step([3, 6], [8, 6], [[3, 4], [7, 8]])
    want = prefill_attention(q, cache, attn, 0.25, k, v)
    got = masked_prefill_attention(q, cache, attn.query_start_loc, attn.seq_lens_t, attn.block_tables, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_positions_past_every_sequence_attend_to_nothing_and_come_out_zero() -> None:
    # A prefill bucket is padded with positions past its sequence (the runner's), not with sequences.
    q, k, v, cache, attn = _step([5], [9], [[2, 3, 5]], num_padding=3)
    got = XlaPagedAttention()(q, k, v, cache, attn, 0.25)  # [8, heads * head_dim]
    assert torch.equal(got[5:], torch.zeros(3, NUM_HEADS * HEAD_DIM))
    real = prefill_attention(q[:5], cache, attn, 0.25, k[:5], v[:5])
    torch.testing.assert_close(got[:5], real, rtol=0, atol=1e-5)


def test_one_query_per_sequence_runs_the_batched_decode() -> None:
    q, k, v, cache, attn = _step([1, 1], [7, 2], [[3, 4], [7, 8]])
    got = XlaPagedAttention()(q, k, v, cache, attn, 0.25)
    want = prefill_attention(q, cache, attn, 0.25, k, v)  # one query each: the same attention
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
