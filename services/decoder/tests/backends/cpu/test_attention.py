"""The CPU executor's attention (backends/cpu/attention.py) in steps with prefill: which rows take the C
kernel, and that a row's bits do not depend on what shares its step.

Every test runs once per build this CPU runs (conftest.py), its limits' `prefill_max_context` cut to
16 so that short contexts stand for long ones; not tiled, so a long chunk goes to SDPA on every build.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tandem.decoder.backends.cpu.attention import CpuPagedAttention
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.models.attention import AttentionMetadata, write_kv_cache
from tandem.decoder.models.torch_attention import prefill_attention

from ...models.helpers import PagedAllocator

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 64, 4, 64
SCALE = HEAD_DIM**-0.5
MAX_CONTEXT = 16  # the limits' prefill_max_context in these tests


def short_limited(kernels: Kernels, ops: Any) -> CpuPagedAttention:
    return CpuPagedAttention(ops, dataclasses.replace(kernels.limits, prefill_max_context=MAX_CONTEXT))


def one_query_each(attn: AttentionMetadata, i: int) -> AttentionMetadata:
    """Sequence i's queries as one-query sequences over its table: how a verification packs its rows
    (engine/step/batch.py)."""
    n = attn.query_lens[i]
    query_lens = attn.query_lens[:i] + [1] * n + attn.query_lens[i + 1 :]
    seq_lens = (
        attn.seq_lens[:i]
        + list(range(attn.seq_lens[i] - n + 1, attn.seq_lens[i] + 1))
        + attn.seq_lens[i + 1 :]
    )
    tables = torch.cat((attn.block_tables[:i], attn.block_tables[i].repeat(n, 1), attn.block_tables[i + 1 :]))
    return AttentionMetadata(
        query_lens=query_lens,
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=attn.slot_mapping,
        block_tables=tables,
        logits_indices=torch.arange(sum(query_lens)),
    )


def only(attn: AttentionMetadata, seqs: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Some of the step's sequences as a step of their own, and their rows in the step's packing."""
    starts = torch.tensor([0, *attn.query_lens]).cumsum(0).tolist()
    rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])])
    index = torch.tensor(seqs)
    step = AttentionMetadata(
        query_lens=[attn.query_lens[i] for i in seqs],
        seq_lens=[attn.seq_lens[i] for i in seqs],
        seq_lens_t=attn.seq_lens_t[index],
        slot_mapping=attn.slot_mapping[rows],
        block_tables=attn.block_tables[index],
        logits_indices=torch.arange(len(rows)),
    )
    return step, rows


def step_over_a_cache(
    dtype: torch.dtype, contexts: list[tuple[str, int]], chunks: list[tuple[str, int]]
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of `chunks` (sequence, new positions) after `contexts` are cached: its metadata, q, k, v
    and the cache with the step's keys and values written (random throughout)."""
    torch.manual_seed(0)
    allocator = PagedAllocator(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    allocator.metadata(contexts)
    attn = allocator.metadata(chunks)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    num_rows = sum(attn.query_lens)
    q = torch.randn(num_rows, NUM_HEADS, HEAD_DIM).to(dtype)
    k, v = torch.randn(2, num_rows, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    write_kv_cache(kv_cache, k, v, attn.slot_mapping)
    return attn, q, k, v, kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_verification_rows_beside_a_long_chunk_get_the_bits_of_a_decode_only_step(
    kernels: Kernels, ops: Any, dtype: torch.dtype
) -> None:
    # A chunk past the kernel's prefill context goes to SDPA; the one-query rows beside it (a decode,
    # a verification's three rows) stay on the kernel that a decode-only step runs them on, so that
    # speculation, whose rows land in other steps than plain decoding's, gives the same logprobs.
    # The chunk keeps SDPA's bits, those of the chunk alone.
    attention = short_limited(kernels, ops)
    contexts = [("decode", 9), ("chunk", 12), ("verify", 13)]
    attn, q, k, v, kv_cache = step_over_a_cache(
        dtype, contexts, [("decode", 1), ("chunk", 24), ("verify", 3)]
    )
    attn = one_query_each(attn, 2)  # seq_lens: 10, 36, 14, 15, 16
    out = attention(q, k, v, kv_cache, attn, SCALE)

    decodes, rows = only(attn, [0, 2, 3, 4])
    assert decodes.is_decode_only
    decode_step = attention(q[rows], None, None, kv_cache, decodes, SCALE)
    assert torch.equal(out[rows], decode_step)
    chunk, chunk_rows = only(attn, [1])
    chunk_alone = prefill_attention(q[chunk_rows], kv_cache, chunk, SCALE, k[chunk_rows], v[chunk_rows])
    assert torch.equal(out[chunk_rows], chunk_alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_chunk_keeps_its_kernel_bits_beside_a_long_decode_row(
    kernels: Kernels, ops: Any, dtype: torch.dtype
) -> None:
    # Only the chunks' contexts choose their kernel: a decode row past the prefill context beside
    # them changes nothing of theirs.
    attention = short_limited(kernels, ops)
    attn, q, k, v, kv_cache = step_over_a_cache(
        dtype, [("decode", 40), ("chunk", 3)], [("decode", 1), ("chunk", 10)]
    )
    out = attention(q, k, v, kv_cache, attn, SCALE)
    chunk, rows = only(attn, [1])
    assert torch.equal(out[rows], attention(q[rows], k[rows], v[rows], kv_cache, chunk, SCALE))
    decode, row = only(attn, [0])
    assert torch.equal(out[row], attention(q[row], None, None, kv_cache, decode, SCALE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_keep_their_kernel_bits_beside_a_long_chunk(
    kernels: Kernels, ops: Any, dtype: torch.dtype
) -> None:
    # Each chunk's own context chooses its path: a neighbour's chunk past the prefill context goes to
    # SDPA without the others, so a prompt's logprobs do not depend on which prompts share its step.
    # The short chunks sit on either side of the long one: their kernel rows are not one run.
    attention = short_limited(kernels, ops)
    attn, q, k, v, kv_cache = step_over_a_cache(
        dtype, [("cached", 3), ("long", 12)], [("cached", 10), ("long", 24), ("fresh", 8)]
    )
    assert attn.seq_lens == [13, 36, 8]
    out = attention(q, k, v, kv_cache, attn, SCALE)
    for seq in range(3):
        alone, rows = only(attn, [seq])
        expected = attention(q[rows], k[rows], v[rows], kv_cache, alone, SCALE)
        assert torch.equal(out[rows], expected), f"sequence {seq}"


def test_chunks_on_sdpa_on_either_side_of_a_decode_row_each_get_their_bits_alone(
    kernels: Kernels, ops: Any
) -> None:
    # The rows go back in packed order; two fresh prompts of one length, apart in the packing, meet
    # in one batched SDPA call once the decode row between them is taken out.
    attention = short_limited(kernels, ops)
    attn, q, k, v, kv_cache = step_over_a_cache(
        torch.float32, [("decode", 20)], [("first", 18), ("decode", 1), ("second", 18)]
    )
    out = attention(q, k, v, kv_cache, attn, SCALE)
    for seq in range(3):
        alone, rows = only(attn, [seq])
        expected = attention(q[rows], k[rows], v[rows], kv_cache, alone, SCALE)
        assert torch.equal(out[rows], expected), f"sequence {seq}"
