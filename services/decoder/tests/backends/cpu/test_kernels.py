"""The C kernels (backends/cpu/csrc) against the torch ops they replace, as wrappers and as custom ops.

Each kernel rounds where the torch path rounds, so in bf16 the norms and RoPE give the torch path's
bits except where an fp32 sum of squares, added up in another order, rounds the other way (one bf16
step, on rare elements); decode attention is checked against a float64 dense reference. Every test
runs on each build this machine's CPU can run (conftest.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from tandem.decoder.backends.cpu.attention import CpuPagedAttention
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.linear import CLinear
from tandem.decoder.models.attention import write_kv_cache
from tandem.decoder.models.layers import RMSNorm, apply_rotary
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.torch_attention import TorchPagedAttention

from ...conftest import Checkpoint
from ...models.helpers import PagedAllocator, PagedRun, dense_decode, hf_greedy

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]


def assert_same_up_to_summation_order(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: equal within 1e-5. bf16: under 1% of elements differ, each by at most one bf16 step."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    assert actual.dtype == expected.dtype == torch.bfloat16
    differs = actual != expected
    assert differs.float().mean() < 0.01
    one_step = expected[differs].float().abs() * 2**-7  # bf16 keeps 8 significant bits
    assert ((actual[differs].float() - expected[differs].float()).abs() <= one_step + 1e-30).all()


def executor_greedy(executor: CpuExecutor, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Prefill then one decode step per token, through the executor and a paged cache."""
    run = PagedRun(executor.model, step=executor)
    tokens = [int(run.step([("s", prompt)])[0].argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(int(run.step([("s", tokens[-1:])])[0].argmax()))
    return tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 512 elements runs on several threads
def test_rms_norm_equals_the_torch_module(kernels, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(512, 1e-6).to(dtype)
    norm.weight.data = torch.randn(512).to(dtype)
    x = (torch.randn(rows, 512) * 3).to(dtype)
    assert_same_up_to_summation_order(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("vocab", [1, 3, 16, 17, 49152 + 5])  # under a register, whole ones, a tail
def test_argmax_is_torch_argmax_first_largest_with_nan_largest(kernels, vocab: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(40, vocab)
    logits[1] = float("-inf")  # nothing larger than the first: 0
    logits[2] = 0.0
    logits[2, vocab // 2] = -0.0  # equal to 0.0: the first still wins
    logits[3, vocab - 1] = logits[3].max() + 1  # the last position (the tail past whole registers)
    logits[4, vocab // 3 :] = 7.0  # ties: the first of them
    logits[5, vocab - 1] = float("nan")  # a NaN beats everything...
    logits[6, vocab // 2] = float("nan")
    logits[6, vocab - 1] = float("nan")  # ...and the first NaN wins
    logits[7, 0] = float("inf")
    logits[8] = float("nan")
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1))
    assert kernels.argmax(logits[:0]).shape == (0,)


def test_argmax_refuses_what_it_cannot_read(kernels) -> None:
    with pytest.raises(ValueError, match="logits must be torch.float32"):
        kernels.argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"logits must have shape \[\*, \*\]"):
        kernels.argmax(torch.zeros(8))
    with pytest.raises(ValueError, match="logits must be contiguous"):
        kernels.argmax(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="at least one column"):
        kernels.argmax(torch.zeros(2, 0))


def torch_qkv_rope_cache(qkv, cos, sin, q_norm, k_norm, kv_cache, slots, num_heads, num_kv_heads, head_dim):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv_cache(kv_cache, k, v, slots)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32])  # 64 has its own compiled case, 32 the generic loop
@pytest.mark.parametrize("with_norms", [True, False])  # Qwen3, Llama
def test_qkv_rope_cache_equals_norms_rotary_and_the_cache_write(
    kernels, dtype: torch.dtype, head_dim: int, with_norms: bool
) -> None:
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, block_size, num_blocks = 9, 8, 2, 4, 6
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    angles = torch.rand(num_tokens, 1, head_dim) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    norms = None
    if with_norms:
        norms = (RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype))
        for n in norms:
            n.weight.data = torch.randn(head_dim).to(dtype)
    slots = torch.tensor([5, 6, 7, 8, 9, 12, 13, 2, 23])
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    expected_cache, actual_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    q_ref, k_ref = torch_qkv_rope_cache(
        qkv, cos, sin, *(norms or (None, None)), expected_cache, slots, num_heads, num_kv_heads, head_dim
    )
    q, k = kernels.qkv_rope_cache(
        qkv,
        cos,
        sin,
        *(None, None) if norms is None else (norms[0].weight, norms[1].weight),
        1e-6,
        actual_cache,
        slots,
        num_heads,
        want_keys=True,
    )
    assert k is not None
    for got, want in ((q, q_ref), (k, k_ref), (actual_cache, expected_cache)):
        assert_same_up_to_summation_order(got, want)
    _, no_keys = kernels.qkv_rope_cache(
        qkv, cos, sin, None, None, 1e-6, actual_cache, slots, num_heads, want_keys=False
    )
    assert no_keys is None


def test_kernels_refuse_slots_and_block_ids_outside_the_cache_and_write_nothing(kernels) -> None:
    cache = torch.zeros(2, 4, 4, 1, 64)
    qkv = torch.randn(2, 3 * 64)
    cos, sin = torch.ones(2, 1, 64), torch.zeros(2, 1, 64)
    with pytest.raises(ValueError, match="KV slot is outside kv_cache"):
        kernels.qkv_rope_cache(qkv, cos, sin, None, None, 1e-6, cache, torch.tensor([3, 16]), 1, True)
    assert cache.count_nonzero() == 0
    q = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match=r"block id \(block_tables\) is outside kv_cache"):
        tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)  # block 4 of a 4-block pool
        kernels.decode_attention(q, cache, tables, torch.tensor([5, 5], dtype=torch.int32), 0.125)
    with pytest.raises(ValueError, match="sequence length"):
        tables = torch.tensor([[1, 2], [3, 1]], dtype=torch.int32)
        kernels.decode_attention(q, cache, tables, torch.tensor([5, 9], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_decode_attention_gives_a_sequence_the_same_bits_whatever_sequences_share_the_call(
    kernels, dtype: torch.dtype, group: int
) -> None:
    # A verification step attends as k + 1 one-query rows; speculation keeps greedy tokens only if
    # each row's result is what it would be alone. The kernel attends a run of one sequence's
    # consecutive positions together (one read of its keys): runs of 3 and 10 rows (longer than a
    # run's 8), across block boundaries, and lengths one apart whose tables differ (no run). Lengths
    # cover empty, whole and partial blocks and partial groups of 4 keys.
    torch.manual_seed(0)
    num_kv_heads, head_dim, block_size = 3, 64, 16
    cache = torch.randn(2, 12, block_size, num_kv_heads, head_dim).to(dtype)
    run = list(range(60, 70))
    seq_lens = torch.tensor([0, 1, 3, 16, 17, 18, 19, 45, 100, 130, *run, 20, 21], dtype=torch.int32)
    tables = torch.stack([torch.randperm(12, dtype=torch.int32)[:9] for _ in seq_lens])
    tables[2:6] = tables[1]  # rows of one sequence: lengths 16, 17, 18 make a run
    tables[10:20] = tables[10]  # one sequence's 10 consecutive positions
    tables[21] = (tables[20] + 1) % 12  # lengths 20, 21 on other blocks: two sequences
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    together = kernels.decode_attention(q, cache, tables, seq_lens, 0.125)
    assert together[0].count_nonzero() == 0  # no context: nothing to attend to
    want = dense_decode(q[1:].double(), cache, tables[1:], seq_lens[1:], 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together[1:].double(), want, atol=tolerance, rtol=tolerance)
    for s in range(len(seq_lens)):
        alone = kernels.decode_attention(q[s : s + 1], cache, tables[s : s + 1], seq_lens[s : s + 1], 0.125)
        assert torch.equal(alone[0], together[s]), f"sequence {s} (length {int(seq_lens[s])})"


@pytest.mark.parametrize("num_kv_heads", [2, 3])
def test_a_decode_step_of_many_sequences_gives_each_the_bits_it_gets_alone(
    kernels, num_kv_heads: int
) -> None:
    # With many one-row sequences (a decode step's: at least 4 per OpenMP thread, whose default is
    # a thread a core) the tiled kernel attends a sequence's KV heads together, tile by tile; alone,
    # a head at a time. Each head's sums keep their order either way.
    torch.manual_seed(num_kv_heads)
    group, head_dim, block_size, num_blocks = 3, 64, 16, 64
    num_seqs = 4 * max(12, os.cpu_count() or 1)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(torch.bfloat16)
    seq_lens = torch.tensor([1 + (37 * s) % 300 for s in range(num_seqs)], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, dtype=torch.int32)[:19] for _ in seq_lens])
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(torch.bfloat16)
    together = kernels.decode_attention(q, cache, tables, seq_lens, 0.125)
    want = dense_decode(q.double(), cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(together.double(), want, atol=2e-2, rtol=2e-2)
    for s in range(len(seq_lens)):
        alone = kernels.decode_attention(q[s : s + 1], cache, tables[s : s + 1], seq_lens[s : s + 1], 0.125)
        assert torch.equal(alone[0], together[s]), f"sequence {s} (length {int(seq_lens[s])})"


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 8), (128, 16), (64, 32)])
def test_a_prefill_as_rows_matches_dense_attention_and_gives_each_row_its_bits_alone(
    kernels, head_dim: int, block_size: int
) -> None:
    # A prefill chunk reaches the kernel as one row per position (attention.py, rows_as_sequences).
    # On AVX512-BF16 builds the tiled kernel takes runs of up to 16 such rows against tiles of 16
    # positions, which cross cache blocks of 8; 45 rows after a 7-position prefix make three runs and
    # a partial one. The slots past the last position hold NaN: a read of them would show.
    torch.manual_seed(head_dim + block_size)
    num_kv_heads, group, num_blocks, prefix, rows = 2, 3, 40, 7, 45
    scale = head_dim**-0.5
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(torch.bfloat16)
    table = torch.randperm(num_blocks, dtype=torch.int32)
    total = prefix + rows
    for position in range(total, -(-total // block_size) * block_size):
        cache[:, table[position // block_size], position % block_size] = float("nan")
    seq_lens = torch.arange(prefix + 1, total + 1, dtype=torch.int32)
    tables = table.repeat(rows, 1)
    q = torch.randn(rows, num_kv_heads * group, head_dim).to(torch.bfloat16)
    together = kernels.decode_attention(q, cache, tables, seq_lens, scale)
    assert torch.isfinite(together.float()).all()
    want = dense_decode(q.double(), cache, tables, seq_lens, scale)
    torch.testing.assert_close(together.double(), want, atol=2e-2, rtol=2e-2)
    for s in (0, 1, 15, 16, 17, 31, 44):
        alone = kernels.decode_attention(q[s : s + 1], cache, tables[s : s + 1], seq_lens[s : s + 1], scale)
        assert torch.equal(alone[0], together[s]), f"row {s} (length {int(seq_lens[s])})"


def test_decode_attention_of_no_rows_is_empty_on_a_thread_that_never_attended(kernels) -> None:
    # The run finder's buffer is per thread: a first call with no rows must not need it.
    cache = torch.zeros(2, 4, 4, 1, 64)
    results = []
    tables, lens = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    no_rows = (torch.zeros(0, 1, 64), cache, tables, lens)
    thread = threading.Thread(target=lambda: results.append(kernels.decode_attention(*no_rows, 0.125)))
    thread.start()
    thread.join()
    assert results[0].shape == (0, 64)


def test_a_nan_query_gives_nan_for_its_row_only(kernels) -> None:
    # As torch's softmax would: a NaN score is not quietly weighted, and a run's other rows keep
    # their own results.
    torch.manual_seed(0)
    cache = torch.randn(2, 4, 16, 1, 64)
    tables = torch.tensor([[2, 0], [2, 0], [2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 6, 7], dtype=torch.int32)  # one run of three rows
    q = torch.randn(3, 1, 64)
    clean = kernels.decode_attention(q, cache, tables, seq_lens, 0.125)
    q[1, 0, 7] = float("nan")
    out = kernels.decode_attention(q, cache, tables, seq_lens, 0.125)
    assert out[1].isnan().all()
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


def test_shapes_past_the_kernels_limits_are_refused_and_attention_keeps_torch_ops(kernels, ops) -> None:
    max_row, max_head_dim = kernels.limits.max_row, kernels.limits.max_head_dim
    with pytest.raises(ValueError, match=rf"x must .* row {max_row + 2} is outside \[1, max_row {max_row}\]"):
        kernels.rms_norm(torch.randn(2, max_row + 2), torch.randn(max_row + 2), 1e-6)
    wide = 2 * max_head_dim
    big_heads = torch.randn(2, 2, 4, 1, wide)
    angles = torch.zeros(1, 1, wide)
    with pytest.raises(
        ValueError, match=rf"kv_cache .* head_dim {wide} is outside \[1, max_head_dim {max_head_dim}\]"
    ):
        kernels.qkv_rope_cache(
            torch.zeros(1, 3 * wide), angles, angles, None, None, 1e-6, big_heads, torch.tensor([0]), 1, True
        )
    q = torch.randn(1, 1, wide)
    attn = PagedAllocator(num_blocks=2, block_size=4).metadata([("s", 3)])
    with pytest.raises(ValueError, match="max_head_dim"):
        kernels.decode_attention(q, big_heads, attn.block_tables, attn.seq_lens_t, 0.1)
    attention = CpuPagedAttention(ops, kernels.limits)
    assert not attention.takes(q, big_heads)
    expected = TorchPagedAttention().decode(q, big_heads, attn, 0.1)
    assert torch.equal(attention.decode(q, big_heads, attn, 0.1), expected)


def test_a_model_on_the_kernels_gives_the_torch_path_logits_and_transformers_greedy_tokens(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    run = PagedRun(model)
    expected = [run.step([("s", PROMPT)]), run.step([("s", [42])]), run.step([("s", [7])])]
    executor = CpuExecutor(model, kernels)
    assert executor.choice.c_ops and executor.choice.build == kernels.level.name
    run = PagedRun(model, step=executor)
    actual = [run.step([("s", PROMPT)]), run.step([("s", [42])]), run.step([("s", [7])])]
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert executor_greedy(executor, PROMPT, 24) == hf_greedy(checkpoint.hf_model, PROMPT, 24)


@pytest.mark.parametrize("linears", [None, "c"])  # the CPU's own choice; the C linears, fused layers
def test_bfloat16_decode_on_the_kernels_stays_close_to_the_torch_path(
    kernels, checkpoint: Checkpoint, linears: Any
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    runs = {}
    for name, step in (("torch", None), ("kernels", CpuExecutor(model, kernels, linears=linears))):
        run = PagedRun(model, step=step)
        runs[name] = [run.step([("s", PROMPT)])] + [run.step([("s", [t])]) for t in (42, 7, 99)]
    for got, want in zip(runs["kernels"], runs["torch"], strict=True):
        # Attention's fp32 softmax (the torch path rounds probabilities to bf16): a few bf16 ulps.
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


# -- the custom ops --------------------------------------------------------------------------------


def op_cases() -> dict[str, list[tuple[Any, ...]]]:
    """Small valid arguments for each op, in each dtype it takes."""
    torch.manual_seed(0)
    cases: dict[str, list[tuple[Any, ...]]] = {name: [] for name in ("rms_norm", "qkv_rope_cache")}
    cases |= {"decode_attention": [], "linear_bf16": []}
    for dtype in (torch.float32, torch.bfloat16):
        cases["rms_norm"].append((torch.randn(3, 64).to(dtype), torch.randn(64).to(dtype), 1e-6))
        angles = torch.rand(3, 1, 16) * 10
        for with_norms, want_keys in ((True, True), (False, False)):
            norms = (torch.randn(16).to(dtype), torch.randn(16).to(dtype)) if with_norms else (None, None)
            cases["qkv_rope_cache"].append(
                (
                    torch.randn(3, (4 + 2 * 2) * 16).to(dtype),
                    angles.cos().to(dtype),
                    angles.sin().to(dtype),
                    *norms,
                    1e-6,
                    torch.zeros(2, 3, 4, 2, 16, dtype=dtype),
                    torch.tensor([4, 5, 11]),
                    4,
                    want_keys,
                )
            )
        cases["decode_attention"].append(
            (
                torch.randn(2, 4, 16).to(dtype),
                torch.randn(2, 3, 4, 2, 16).to(dtype),
                torch.tensor([[1, 2], [0, 0]], dtype=torch.int32),
                torch.tensor([6, 3], dtype=torch.int32),
                0.25,
            )
        )
    weight, bias = torch.randn(24, 32).bfloat16(), torch.randn(24).bfloat16()
    cases["linear_bf16"] = [
        (torch.randn(5, 32).bfloat16(), weight, bias),
        (torch.randn(1, 32).bfloat16(), weight, None),
    ]
    return cases


@pytest.mark.parametrize("name", ["rms_norm", "qkv_rope_cache", "decode_attention", "linear_bf16"])
def test_each_custom_op_passes_torch_opcheck_with_its_fake_implementation(ops, name: str) -> None:
    for args in op_cases()[name]:
        torch.library.opcheck(getattr(ops, name), args)


@pytest.fixture
def thread_counts() -> Iterator[Sequence[int]]:
    original = torch.get_num_threads()
    try:
        yield (1, 2, 3)
    finally:
        torch.set_num_threads(original)


def test_a_kernels_result_bits_do_not_depend_on_the_thread_count(kernels, thread_counts) -> None:
    torch.manual_seed(0)
    cache = torch.randn(2, 40, 16, 2, 64).bfloat16()
    seq_lens = torch.randint(1, 160, (33,), dtype=torch.int32)
    tables = torch.stack([torch.randperm(40, dtype=torch.int32)[:10] for _ in range(33)])
    q = torch.randn(33, 8, 64).bfloat16()
    x, weight = (torch.randn(300, 512) * 3).bfloat16(), torch.randn(512).bfloat16()
    linear = CLinear(kernels, torch.randn(131, 1000).bfloat16(), torch.randn(131).bfloat16())
    rows = torch.randn(300, 1000).bfloat16()
    results = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        results.append(
            (
                kernels.decode_attention(q, cache, tables, seq_lens, 0.125),
                kernels.rms_norm(x, weight, 1e-6),
                linear(rows),
            )
        )
    for threads, result in zip(thread_counts[1:], results[1:], strict=True):
        for name, got, want in zip(
            ("decode_attention", "rms_norm", "linear"), result, results[0], strict=True
        ):
            assert torch.equal(got, want), f"{name} on {threads} threads differs from 1 thread"
