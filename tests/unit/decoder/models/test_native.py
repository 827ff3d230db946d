"""The C kernels (models/native_kernels.c) against the torch ops they replace, and how they are built.

Each kernel rounds where the torch path rounds, so in bf16 the norms and RoPE give the torch path's
bits except where an fp32 sum of squares, added up in another order, rounds the other way (one bf16
step, on rare elements); decode attention is checked against a dense reference in test_attention.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.decoder.models import native
from services.decoder.models.attention import write_kv_cache
from services.decoder.models.layers import RMSNorm, apply_rotary
from services.decoder.models.loader import load_model

from .conftest import Checkpoint
from .helpers import PagedRun, dense_decode, greedy, hf_greedy

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 512 elements runs on several threads
def test_rms_norm_equals_the_torch_module(kernels, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(512, 1e-6).to(dtype)
    norm.weight.data = torch.randn(512).to(dtype)
    x = (torch.randn(rows, 512) * 3).to(dtype)
    expected = norm(x)
    norm.native = kernels
    actual = norm(x)
    assert_same_up_to_summation_order(actual, expected)


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


def test_a_model_on_the_kernels_gives_the_torch_path_logits_and_transformers_greedy_tokens(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    run = PagedRun(model)
    expected = [run.step([("s", PROMPT)]), run.step([("s", [42])]), run.step([("s", [7])])]
    model.use_native_kernels(kernels)
    run = PagedRun(model)
    actual = [run.step([("s", PROMPT)]), run.step([("s", [42])]), run.step([("s", [7])])]
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert greedy(model, PROMPT, 24) == hf_greedy(checkpoint.hf_model, PROMPT, 24)


def test_bfloat16_decode_on_the_kernels_stays_close_to_the_torch_path(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    runs = {}
    for name in ("torch", "native"):
        model.use_native_kernels(kernels if name == "native" else None)
        run = PagedRun(model)
        runs[name] = [run.step([("s", PROMPT)])] + [run.step([("s", [t])]) for t in (42, 7, 99)]
    for got, want in zip(runs["native"], runs["torch"], strict=True):
        # Attention's fp32 softmax (the torch path rounds probabilities to bf16): a few bf16 ulps.
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_the_library_is_built_once_per_source_and_reused(tmp_path: Path) -> None:
    first = native.build(tmp_path)
    built_at = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == built_at
    # The library, its recorded sha256 and the builders' lock; no scratch left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", first.name, first.name + ".sha256"]


def test_without_a_compiler_loading_says_so_and_the_model_keeps_torch_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.COMPILER_ENV, "no-such-cc")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-cc' on PATH"):
        native.build()
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_a_broken_build_reports_the_compiler_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int tandem_decode_attention( {\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="building broken.c failed"):
        native.build(tmp_path / "cache")


def test_shapes_past_the_kernels_limits_stay_on_torch_ops(kernels) -> None:
    wide = RMSNorm(native.MAX_ROW + 2, 1e-6)
    x = torch.randn(2, native.MAX_ROW + 2)
    expected = wide(x)
    wide.native = kernels
    assert torch.equal(wide(x), expected)
    big_heads = torch.zeros(2, 2, 4, 1, 2 * native.MAX_HEAD_DIM)
    qkv = torch.zeros(1, 3 * 2 * native.MAX_HEAD_DIM)
    assert not kernels.supports_qkv(qkv, qkv[:, :1], qkv[:, :1], big_heads)
    assert not kernels.supports_decode(torch.zeros(1, 1, 2 * native.MAX_HEAD_DIM), big_heads)
