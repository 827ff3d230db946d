"""Every paged attention implementation against dense causal fp64 attention over each sequence's keys.

The cache starts full of large garbage, so any read of the null block, of a padded block-table entry
or of a slot past a sequence's end would show in the output. Each test runs every implementation:
torch ops, torch ops behind the CPU executor's C decode kernel (backends/cpu/attention.py), and
FlexAttention over block masks from the block tables (the CUDA implementation's code, on
FlexAttention's eager CPU path).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tandem.decoder.backends.cpu import attention as cpu_attention
from tandem.decoder.backends.cpu.kernels import load_for_cpu
from tandem.decoder.backends.cpu.ops import register
from tandem.decoder.models.attention import AttentionMetadata, PagedAttention, write_kv_cache
from tandem.decoder.models.flex_attention import FlexPagedAttention
from tandem.decoder.models.torch_attention import TorchPagedAttention

from .helpers import PagedAllocator

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4
SCALE = HEAD_DIM**-0.5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [query_len, heads, hd] for the last query_len positions of k, v: [seq_len, kv_heads, hd]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [seq_len, heads, hd]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * SCALE
    is_future = torch.ones(query_len, seq_len, dtype=torch.bool).triu(seq_len - query_len + 1)
    probs = scores.masked_fill(is_future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).reshape(query_len, -1).float()


@pytest.fixture(params=["torch", "native", "flex"])
def attention(request: pytest.FixtureRequest) -> PagedAttention:
    if request.param == "flex":
        return FlexPagedAttention()
    if request.param == "torch":
        return TorchPagedAttention()
    return native_attention()


def run_steps(
    steps: list[list[tuple[str, int]]],
    attention: PagedAttention,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Writes random k/v for each step's chunks (key, new tokens) and attends; returns the last step's
    output and the per-sequence dense reference for its queries."""
    torch.manual_seed(0)
    allocator = PagedAllocator(num_blocks=64, block_size=BLOCK_SIZE)
    kv_cache = torch.full((2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), 1e4, dtype=dtype)
    keys: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for chunks in steps:
        attn = allocator.metadata(chunks)
        num_tokens = sum(n for _, n in chunks)
        q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)
        k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        write_kv_cache(kv_cache, k, v, attn.slot_mapping)
        out = attention(q, k, v, kv_cache, attn, SCALE)
        refs, start = [], 0
        for key, n in chunks:
            keys[key] = torch.cat((keys.get(key, k[:0]), k[start : start + n]))
            values[key] = torch.cat((values.get(key, v[:0]), v[start : start + n]))
            refs.append(dense_attention(q[start : start + n].float(), keys[key].float(), values[key].float()))
            start += n
    return out, torch.cat(refs), attn


def test_prefill_of_several_sequences_matches_dense_causal_attention(attention: PagedAttention) -> None:
    out, ref, attn = run_steps([[("a", 5), ("b", 9), ("c", 1)]], attention)
    assert not attn.is_decode_only
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_run_of_equal_length_fresh_prompts_matches_dense_attention(attention: PagedAttention) -> None:
    # Batched as one call: no cached prefix, one length; "d" breaks the run, "e" and "f" start another.
    out, ref, _ = run_steps([[("a", 6), ("b", 6), ("c", 6), ("d", 3), ("e", 6), ("f", 6)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_equal_length_fresh_prompts_alone_match_dense_attention(attention: PagedAttention) -> None:
    # Nothing cached and one length: FlexPagedAttention's one-SDPA path.
    out, ref, _ = run_steps([[("a", 7), ("b", 7), ("c", 7)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefill_chunk_attends_to_the_cached_prefix(attention: PagedAttention) -> None:
    out, ref, _ = run_steps([[("a", 6), ("b", 3)], [("a", 3), ("b", 7)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_long_chunk_over_a_long_prefix_spans_several_query_and_key_blocks(
    attention: PagedAttention,
) -> None:
    # 37 queries after 23 cached positions: three 16-row query blocks, each with full and partial blocks.
    out, ref, _ = run_steps([[("a", 23), ("b", 2)], [("a", 37), ("b", 1)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mixed_step_with_decode_and_prefill_sequences(attention: PagedAttention) -> None:
    out, ref, _ = run_steps([[("a", 6), ("b", 3)], [("a", 1), ("b", 5), ("c", 2)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_batch_matches_dense_attention_with_ragged_lengths_and_padded_tables(
    attention: PagedAttention,
) -> None:
    steps = [[("a", 1), ("b", 10), ("c", 4)], [("a", 1), ("b", 1), ("c", 1)], [("a", 1), ("b", 1), ("c", 1)]]
    out, ref, attn = run_steps(steps, attention)
    assert attn.is_decode_only and attn.block_tables[0, 1:].eq(0).all()  # "a" is padded with the null block
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_long_decode_context_spanning_many_blocks_matches_dense_attention(
    attention: PagedAttention,
) -> None:
    # 61 cached positions over 16 blocks: the online softmax rescales as each block raises the maximum.
    out, ref, _ = run_steps([[("a", 60), ("b", 5)], [("a", 1), ("b", 1)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_of_contexts_that_fill_their_last_block_exactly(attention: PagedAttention) -> None:
    # 8 and 4 positions after the step: no partial block, every listed block is whole.
    out, ref, _ = run_steps([[("a", 7), ("b", 3)], [("a", 1), ("b", 1)]], attention)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_in_half_precision_stays_close_to_the_fp32_reference(
    dtype: torch.dtype, attention: PagedAttention
) -> None:
    # float16 has no C kernel: the native run shows it falls back to torch ops.
    out, ref, _ = run_steps([[("a", 7), ("b", 2)], [("a", 1), ("b", 1)]], attention, dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_tokens_past_the_scheduled_ones_are_padding_with_zero_output(attention: PagedAttention) -> None:
    allocator = PagedAllocator(num_blocks=8, block_size=BLOCK_SIZE)
    kv_cache = torch.zeros(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    for chunks in ([("a", 3)], [("a", 1)]):
        attn = allocator.metadata(chunks)
        num_real = sum(n for _, n in chunks)
        k = torch.randn(num_real + 2, NUM_KV_HEADS, HEAD_DIM)
        # The two padding tokens write to the null block (slots 0 and 1).
        slots = torch.cat((attn.slot_mapping, torch.tensor([0, 1])))
        write_kv_cache(kv_cache, k, k, slots)
        q = torch.randn(num_real + 2, NUM_HEADS, HEAD_DIM)
        out = attention(q, k, k, kv_cache, attn, SCALE)
        assert out.shape == (num_real + 2, NUM_HEADS * HEAD_DIM)
        assert out[num_real:].eq(0).all() and out[:num_real].ne(0).any()


def test_write_kv_cache_puts_keys_and_values_at_their_slots() -> None:
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k, v = torch.randn(2, NUM_KV_HEADS, HEAD_DIM), torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    write_kv_cache(kv_cache, k, v, torch.tensor([2 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE]))
    assert torch.equal(kv_cache[0, 2, 1], k[0]) and torch.equal(kv_cache[1, 3, 0], v[1])
    assert kv_cache.count_nonzero() == 2 * 2 * NUM_KV_HEADS * HEAD_DIM


# -- the C kernel in steps with prefill (TorchPagedAttention with the kernels) -------------------------


def native_attention(prefill_max_context: int | None = None) -> cpu_attention.CpuPagedAttention:
    """The C kernel's attention, not tiled, up to the build's prefill context (or the one given)."""
    loaded = load_for_cpu()
    assert loaded is not None, "the C kernels are built when the project is installed (make setup)"
    limits = loaded.limits
    if prefill_max_context is not None:
        limits = dataclasses.replace(limits, prefill_max_context=prefill_max_context)
    return cpu_attention.CpuPagedAttention(register(loaded), limits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefilled_position_gets_the_bits_a_decode_step_gives_it(dtype: torch.dtype) -> None:
    # With the kernels a short prefill attends one row per token through the decode kernel, so a
    # position's output does not depend on whether it came in a prompt or a decode step (a
    # preempted sequence's recompute, a verification step's rows, a prompt scored for logprobs).
    attention = native_attention()
    allocator = PagedAllocator(num_blocks=64, block_size=BLOCK_SIZE)
    kv_cache = torch.zeros(2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    torch.manual_seed(0)
    q = torch.randn(11, NUM_HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(2, 11, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    attn = allocator.metadata([("prefix", 3), ("a", 11)])  # "a" 11 fresh tokens beside another prompt
    prefix_q = torch.randn(3, NUM_HEADS, HEAD_DIM, dtype=dtype)
    k_all, v_all = torch.cat((torch.randn_like(k[:3]), k)), torch.cat((torch.randn_like(v[:3]), v))
    write_kv_cache(kv_cache, k_all, v_all, attn.slot_mapping)
    prefilled = attention(torch.cat((prefix_q, q)), k_all, v_all, kv_cache, attn, SCALE)[3:]
    for position in range(11):  # the same queries one at a time, as decode steps over the same cache
        decode = AttentionMetadata(
            query_lens=[1],
            seq_lens=[position + 1],
            seq_lens_t=torch.tensor([position + 1], dtype=torch.int32),
            slot_mapping=attn.slot_mapping[3 + position : 4 + position],
            block_tables=attn.block_tables[1:],
            logits_indices=torch.tensor([0]),
        )
        decoded = attention(q[position : position + 1], None, None, kv_cache, decode, SCALE)
        assert torch.equal(decoded[0], prefilled[position]), f"position {position}"


def test_a_prefill_past_the_native_context_limit_runs_on_sdpa_and_still_matches() -> None:
    attention = native_attention(prefill_max_context=5)
    calls = []
    attention.ops = SimpleNamespace(decode_attention=lambda *a: calls.append(a))
    # Every chunk's own context is past the limit (6 and 7, then 9 and 10): each chunk decides for
    # itself (backends/cpu/attention.py's NOTE), so none may reach the kernel.
    out, ref, _ = run_steps([[("a", 6), ("b", 7)], [("a", 3), ("b", 3)]], attention)
    assert calls == []
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_fresh_sequence_longer_than_its_table_stays_on_sdpa() -> None:
    # A static-shape padding sequence: its tokens' keys go to the null block, its one-block table
    # holds fewer positions than its length, and it attends only to its own fresh keys. The C
    # kernel reads keys through the table, so such a step must stay on SDPA.
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    num_tokens = 3 * BLOCK_SIZE
    attn = AttentionMetadata(
        query_lens=[num_tokens],
        seq_lens=[num_tokens],
        seq_lens_t=torch.tensor([num_tokens], dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),  # every padding key in the null slot
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        logits_indices=torch.tensor([num_tokens - 1]),
    )
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM)
    write_kv_cache(kv_cache, k, v, attn.slot_mapping)
    out = native_attention()(q, k, v, kv_cache, attn, SCALE)
    torch.testing.assert_close(out, dense_attention(q, k, v), atol=1e-5, rtol=1e-5)
