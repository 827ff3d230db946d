"""Kernels chosen by measurement (backends/cpu/kernel_choice.py): which candidate wins from made-up
timings, the cache (a second start times nothing; another CPU, build or model times again), the
--cpu-kernels override, and a split step keeping decode rows on their exact kernel."""

from __future__ import annotations

import ctypes
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem.client.errors import ConfigError
from tandem.common.torch_part.quantized_tensor import quantize
from tandem.decoder.backends.cpu import executor as cpu_executor
from tandem.decoder.backends.cpu import kernel_choice
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernel_choice import (
    CPU_KERNELS,
    Family,
    KernelOptions,
    LinearPlan,
    Shape,
    Timing,
    decide,
    decide_int8_tiles,
    measure,
)
from tandem.decoder.backends.cpu.kernels import Kernels, load_for_cpu
from tandem.decoder.backends.cpu.linear import PackedLinear, has_onednn_bf16
from tandem.decoder.config import EngineConfig
from tandem.decoder.models import quantized
from tandem.decoder.models.loader import load_model

from ...conftest import Checkpoint
from ...models.helpers import PagedRun, greedy_batch
from .conftest import emulated_tile_products

QKV, HEAD = (960, 576), (49152, 576)
COUNTS = {QKV: 30, HEAD: 1}
OPTIONS = KernelOptions(exact_rows=68, max_rows=2048)  # exact buckets 1, 4, 16, 32; prefill 128, 512


def timings(speed: dict[str, float], shapes=(QKV, HEAD), options: KernelOptions = OPTIONS) -> list[Timing]:
    """Every kernel at every cell, its time rows / speed[kernel] (onednn only at prefill row counts; the
    head, whose calls have a row per sampled position, only at the exact ones), as `measure` times."""
    out = []
    for shape in shapes:
        for rows in (*options.exact_buckets, *(options.prefill_buckets if shape != HEAD else ())):
            for kernel, s in speed.items():
                if kernel == "onednn" and rows <= options.exact_rows:
                    continue
                out.append(Timing(kernel, shape, rows, rows / s))
    return out


def slower(ts: list[Timing], kernel: str, factor: float, rows: tuple[int, ...] | None = None, shape=None):
    return [
        Timing(t.kernel, t.shape, t.rows, t.seconds * factor)
        if t.kernel == kernel and (rows is None or t.rows in rows) and (shape is None or t.shape == shape)
        else t
        for t in ts
    ]


FAMILIES = [Family("avx512bf16", ("avx512bf16",)), Family("avx512", ("avx512",)), Family("avx2", ("avx2",))]


def test_the_fastest_build_wins_and_is_logged_with_its_table() -> None:
    plan = decide(timings({"avx512bf16": 1.0, "avx512": 1.0, "avx2": 2.0}), COUNTS, FAMILIES[::-1], OPTIONS)
    assert plan.level == "avx2" and plan.exact_of(QKV) == "avx2" and plan.prefill_of(QKV) == "avx2"
    assert not plan.splits_prefill and plan.tile_rows(QKV) == 0
    assert "960x576 x    1 rows: avx2* " in plan.table() and plan.describe().startswith(
        "avx2 build (measured)"
    )


def test_the_default_build_stays_unless_another_is_faster_by_the_margin() -> None:
    assert (
        decide(timings({"avx512bf16": 1.0, "avx2": 1.03}), COUNTS, FAMILIES[::2], OPTIONS).level
        == "avx512bf16"
    )
    assert decide(timings({"avx512bf16": 1.0, "avx2": 1.2}), COUNTS, FAMILIES[::2], OPTIONS).level == "avx2"


def test_one_cell_slowed_by_a_neighbour_does_not_move_the_choice() -> None:
    """A thread descheduled mid-sample costs milliseconds: the median over cells ignores one such cell."""
    ts = slower(timings({"avx512bf16": 1.0, "avx2": 0.7}), "avx512bf16", 20.0, rows=(1,), shape=HEAD)
    assert decide(ts, COUNTS, FAMILIES[::2], OPTIONS).level == "avx512bf16"


def test_the_amx_build_tiles_each_shape_where_tiles_win() -> None:
    amx = [Family("amx", ("avx512bf16", "amx"))]
    ts = slower(timings({"avx512bf16": 1.0, "amx": 4.0}), "amx", 16.0, shape=HEAD)  # tiles: 4x, head 0.25x
    plan = decide(ts, COUNTS, amx, OPTIONS)
    assert plan.level == "amx" and plan.exact_of(QKV) == "amx" and plan.exact_of(HEAD) == "avx512bf16"
    assert plan.tile_rows(QKV) == 1 and plan.tile_rows(HEAD) == 0


def test_tiles_only_for_prefill_chunks_when_they_lose_on_decode_rows() -> None:
    amx = [Family("amx", ("avx512bf16", "amx"))]
    ts = slower(timings({"avx512bf16": 1.0, "amx": 4.0}), "amx", 8.0, rows=OPTIONS.exact_buckets)
    plan = decide(ts, COUNTS, amx, OPTIONS)
    assert plan.exact_of(QKV) == "avx512bf16" and plan.prefill_of(QKV) == "amx"
    assert plan.tile_rows(QKV) == OPTIONS.prefill_rows == 69 and plan.splits_prefill


def test_onednn_is_a_candidate_for_prefill_chunks_only_and_must_win_by_the_prefill_margin() -> None:
    plan = decide(timings({"avx512bf16": 1.0, "onednn": 3.0}), COUNTS, FAMILIES[:1], OPTIONS, ["onednn"])
    assert plan.exact_of(QKV) == "avx512bf16" and plan.prefill_of(QKV) == "onednn"
    assert plan.onednn_shapes == {QKV} and plan.splits_prefill  # the head has no prefill chunks
    close = decide(timings({"avx512bf16": 1.0, "onednn": 1.15}), COUNTS, FAMILIES[:1], OPTIONS, ["onednn"])
    assert not close.splits_prefill  # 15 % does not pay for a second pass over the weights
    # Twice as fast at 128 rows only because the exact kernel's sample there was slowed: not chosen.
    one_cell = slower(timings({"avx512bf16": 1.0, "onednn": 0.9}), "avx512bf16", 2.0, rows=(128,))
    assert not decide(one_cell, COUNTS, FAMILIES[:1], OPTIONS, ["onednn"]).splits_prefill


def test_batch_invariant_keeps_every_call_on_the_exact_kernels() -> None:
    options = KernelOptions(exact_rows=68, max_rows=2048, prefill_kernels=False)
    assert options.prefill_buckets == ()
    plan = decide(timings({"avx512bf16": 1.0, "onednn": 3.0}, options=options), COUNTS, FAMILIES[:1], options)
    assert plan.prefill_of(QKV) == "avx512bf16" and not plan.splits_prefill


def test_measure_interleaves_candidates_and_stops_timing_one_slower_on_every_shape() -> None:
    now = [0.0]
    calls: dict[str, list[int]] = {}

    def binder(name: str, cost: float):
        def bind(weight: torch.Tensor):
            def call(x: torch.Tensor) -> torch.Tensor:
                calls.setdefault(name, []).append(x.shape[0])
                now[0] += cost * x.shape[0] * weight.shape[0]
                return x

            return call

        return bind

    weights = {
        (8, 16): torch.zeros(8, 16, dtype=torch.bfloat16),
        (4, 16): torch.zeros(4, 16, dtype=torch.bfloat16),
    }
    binders = {"fast": binder("fast", 1e-6), "slow": binder("slow", 4e-6), "default": binder("default", 3e-6)}
    buckets = {s: (1, 4, 16) for s in weights}
    got = measure(binders, weights, buckets, (), 16, keep=("default",), clock=lambda: now[0])
    assert {t.kernel for t in got if t.rows == 1} == {"fast", "slow", "default"}
    assert {t.kernel for t in got if t.rows > 1} == {
        "fast",
        "default",
    }  # slow: 4x on every shape; default kept
    assert 4 not in calls["slow"] and 16 not in calls["slow"]
    fast = next(t for t in got if t.kernel == "fast" and t.shape == (8, 16) and t.rows == 4)
    assert fast.seconds == pytest.approx(1e-6 * 4 * 8)


# -- at load: the cache and the override --------------------------------------------------------------


@pytest.fixture
def bf16_model(checkpoint: Checkpoint):
    return load_model(checkpoint.path, dtype="bfloat16").model


def counted_measure(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """measure replaced by made-up timings (the highest build fastest), and the tiny checkpoints
    measured as a real model is; returns the call count."""
    count = [0]
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_BYTES", 0)

    def fake(binders, weights, buckets, prefill_only, exact_rows, keep=(), clock=None):
        count[0] += 1
        return [
            Timing(kernel, shape, rows, rows * shape[0] * (1.0 if kernel in keep else 2.0))
            for shape, rs in buckets.items()
            for rows in rs
            for kernel in binders
            if rows > exact_rows or kernel not in prefill_only
        ]

    monkeypatch.setattr(kernel_choice, "measure", fake)
    return count


def test_a_second_start_reads_the_cached_choice_and_times_nothing(
    bf16_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    count = counted_measure(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, cache_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=kernel_choice.log.name):
        kernels, first = kernel_choice.choose(bf16_model, options)
    assert count[0] == 1 and first is not None and first.source == "measured"
    assert kernels is not None and kernels.level.name == first.level == load_for_cpu().level.name
    assert len(json.loads((tmp_path / kernel_choice.CACHE_FILE).read_text())["entries"]) == 1
    assert first.table() in caplog.text  # the measured table, logged once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=kernel_choice.log.name):
        _, second = kernel_choice.choose(bf16_model, options)
    assert count[0] == 1 and second == first and second.source == "cached"
    assert second.timings == first.timings  # the table in the file is the one measured
    # A start that measures nothing says its choice in one line; the table is in the file.
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]


@pytest.mark.parametrize("change", ["cpu", "build", "shapes"])
def test_the_cache_key_changes_with_the_cpu_the_build_and_the_shapes(
    change: str, bf16_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = counted_measure(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, cache_dir=tmp_path)
    kernel_choice.choose(bf16_model, options)
    cpu = this_cpu()
    if change == "cpu":
        cpu = CpuInfo(cpu.machine, cpu.model_name + " (another)", cpu.flags)
    elif change == "build":
        monkeypatch.setattr(kernel_choice, "build_id", lambda level: "0123456789abcdef")
    else:
        options = KernelOptions(exact_rows=8, max_rows=256, cache_dir=tmp_path)  # other row buckets
    kernel_choice.choose(bf16_model, options, cpu)
    assert count[0] == 2
    assert len(json.loads((tmp_path / kernel_choice.CACHE_FILE).read_text())["entries"]) == 2


def test_cpu_kernels_names_a_build_and_nothing_is_timed(bf16_model, monkeypatch: pytest.MonkeyPatch) -> None:
    count = counted_measure(monkeypatch)
    lowest = this_cpu() and kernel_choice.runnable_levels(this_cpu())[0].name
    kernels, plan = kernel_choice.choose(bf16_model, KernelOptions(kernels=lowest))
    assert count[0] == 0 and kernels is not None and kernels.level.name == lowest
    assert plan is not None and plan.source == "--cpu-kernels" and {k for _, k in plan.exact} == {lowest}


def test_a_build_this_cpu_cannot_run_is_refused_naming_the_flag_and_what_it_needs() -> None:
    cpu = CpuInfo("x86_64", "an AVX2 CPU", frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()))
    with pytest.raises(
        ConfigError,
        match=r"^cpu_kernels: amx cannot run on this CPU \(it needs amx_bf16 amx_tile avx512_bf16 .*\); "
        r"it runs x86_64, avx2 \(or auto\)$",
    ):
        kernel_choice.check_kernels("amx", cpu)


def test_an_unknown_build_is_refused_naming_the_choices(checkpoint: Checkpoint) -> None:
    with pytest.raises(ConfigError, match=r"^cpu_kernels must be one of \('auto', 'x86_64', "):
        EngineConfig(model_dir=checkpoint.path, cpu_kernels="avx1024")
    assert CPU_KERNELS[0] == "auto"
    options = EngineConfig(model_dir=checkpoint.path, batch_invariant=True).kernel_options
    assert options.cache_dir == checkpoint.path and not options.prefill_kernels and options.exact_rows == 68


# -- a split step -------------------------------------------------------------------------------------


@pytest.mark.skipif(not has_onednn_bf16(), reason="this CPU's oneDNN has no bf16 path: not a candidate")
def test_decode_rows_beside_a_prefill_chunk_on_onednn_keep_their_bits_alone(bf16_model) -> None:
    """With oneDNN for prefill chunks of 9+ rows, a step of one decode row and a 12-row chunk runs in
    two parts: the decode row gets the bits it gets alone, the chunk the model's tokens."""
    kernels = load_for_cpu()
    assert kernels is not None
    weights = [linear.weight for linear in kernel_choice.projections(bf16_model)]
    shapes: list[Shape] = sorted({(w.shape[0], w.shape[1]) for w in weights})
    exact = tuple((s, kernels.level.name) for s in shapes)
    plan = LinearPlan(kernels.level.name, exact, tuple((s, "onednn") for s in shapes), 9, "test")
    executor = CpuExecutor(bf16_model, kernels, dense_rows=9, plan=plan)
    assert executor.split_rows == 9 and executor.prefill_layers
    assert all(isinstance(layer.gate_up, PackedLinear) for layer in executor.prefill_layers)
    chunk = [5, 17, 3, 99, 250, 31, 7, 8, 64, 12, 1000, 3]
    together, alone = PagedRun(bf16_model, step=executor), PagedRun(bf16_model, step=executor)
    for run in (together, alone):
        run.step([("a", [17, 402, 33, 981, 5])])
    mixed = together.step([("a", [42]), ("b", chunk)])
    assert torch.equal(mixed[0], alone.step([("a", [42])])[0])
    reference = PagedRun(bf16_model).step([("b", chunk)])[0]
    assert int(mixed[1].argmax()) == int(reference.argmax())


def test_a_model_too_small_to_pay_for_a_measurement_keeps_the_flags_choice(
    bf16_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = counted_measure(monkeypatch)
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_BYTES", 16 << 20)  # the tiny checkpoints: < 1 MB
    kernels, plan = kernel_choice.choose(bf16_model, KernelOptions(exact_rows=16, max_rows=256))
    assert count[0] == 0 and plan is None and kernels is load_for_cpu()


def test_the_executor_logs_the_measured_choice(bf16_model, monkeypatch: pytest.MonkeyPatch) -> None:
    counted_measure(monkeypatch)
    executor = cpu_executor.bind(bf16_model, KernelOptions(exact_rows=16, max_rows=256))
    assert f"{executor.choice.build} build (measured); linears " in executor.choice.describe()


# -- int8 activations: VPDPBUSD or AMX-INT8 tiles -----------------------------------------------------

VECTOR, TILES = kernel_choice.INT8_VECTOR, kernel_choice.INT8_TILES


def int8_timings(tiles_speedup: dict[int, float], shape: Shape = QKV) -> list[Timing]:
    """The vector kernel at `rows` ms per row count, the tiles tiles_speedup[rows] times faster (1:
    the same)."""
    return [
        t
        for rows in OPTIONS.int8_buckets
        for t in (
            Timing(VECTOR, shape, rows, rows),
            Timing(TILES, shape, rows, rows / tiles_speedup.get(rows, 1)),
        )
    ]


def test_int8_tiles_start_at_the_first_row_count_from_which_they_win_by_the_margin() -> None:
    assert OPTIONS.int8_buckets == (1, 4, 16, 32, 128, 512)
    later = {16: 2.0, 32: 3.0, 128: 4.0, 512: 4.0}
    assert decide_int8_tiles(int8_timings(later), [QKV]).as_map() == {QKV: 16}
    # A win at 4 rows and a loss at 16: not from 4
    dip = {4: 2.0, 16: 0.9, 32: 2.0, 128: 2.0, 512: 2.0}
    assert decide_int8_tiles(int8_timings(dip), [QKV]).as_map() == {QKV: 32}
    everywhere = decide_int8_tiles(int8_timings(dict.fromkeys(OPTIONS.int8_buckets, 2.0)), [QKV])
    assert everywhere.as_map() == {QKV: 1}
    assert "amx-int8 tiles from 1 rows (960x576), else vpdpbusd (measured)" in everywhere.describe()
    # Within the margin, or a cell the tiles lack: the vector kernel throughout
    close = dict.fromkeys(OPTIONS.int8_buckets, 1.04)
    assert decide_int8_tiles(int8_timings(close), [QKV]).as_map() == {}
    missing = [t for t in int8_timings(later) if not (t.kernel == TILES and t.rows == 512)]
    assert decide_int8_tiles(missing, [QKV]).as_map() == {}


@pytest.fixture
def int8_model(checkpoint: Checkpoint):
    model = load_model(checkpoint.path, dtype="bfloat16").model
    dense = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    quantized.apply(model, {name: quantize(p, 4) for name, p in dense.items()})
    return model


def amx_cpu() -> CpuInfo:
    cpu = this_cpu()
    return CpuInfo(cpu.machine, cpu.model_name, cpu.flags | {"amx_tile", "amx_bf16", "amx_int8"})


def tiles_from_16(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """measure replaced by made-up timings, the tiles twice as fast from 16 rows; returns the call
    count."""
    count = [0]
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_BYTES", 0)

    def fake(binders, weights, buckets, prefill_only, exact_rows, keep=(), clock=None):
        count[0] += 1
        assert set(binders) == {VECTOR, TILES} and set(keep) == {VECTOR, TILES}  # neither pruned
        return [
            Timing(kernel, shape, rows, rows / (2.0 if kernel == TILES and rows >= 16 else 1.0))
            for shape, rs in buckets.items()
            for rows in rs
            for kernel in binders
        ]

    monkeypatch.setattr(kernel_choice, "measure", fake)
    return count


def test_int8_tiles_are_measured_once_then_cached_and_cpu_kernels_amx_tiles_every_call(
    int8_model, emulated_tiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = tiles_from_16(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, cache_dir=tmp_path, int8_activations=True)
    shapes = set(kernel_choice.quantized_weights(int8_model)[0])
    first = kernel_choice.int8_tiles(int8_model, emulated_tiles, options, amx_cpu())
    assert count[0] == 1 and first is not None and first.source == "measured"
    assert first.as_map() == dict.fromkeys(shapes, 16)
    second = kernel_choice.int8_tiles(int8_model, emulated_tiles, options, amx_cpu())
    assert count[0] == 1 and second == first and second.source == "cached"
    # An entry this code did not write (a row count of 0) is measured again and rewritten.
    cache = tmp_path / kernel_choice.CACHE_FILE
    written = json.loads(cache.read_text())
    for entry in written["entries"].values():
        entry["tile_rows"] = [[n, k, 0] for n, k, _ in entry["tile_rows"]]
    cache.write_text(json.dumps(written))
    third = kernel_choice.int8_tiles(int8_model, emulated_tiles, options, amx_cpu())
    assert count[0] == 2 and third == first and third.source == "measured"
    named = replace(options, kernels="amx")
    assert kernel_choice.int8_tiles(int8_model, emulated_tiles, named, amx_cpu()).as_map() == dict.fromkeys(
        shapes, 1
    )
    assert count[0] == 2  # the override times nothing


def test_no_int8_tile_choice_without_the_mode_the_tiles_or_amx_int8(
    int8_model, bf16_model, emulated_tiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = tiles_from_16(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, int8_activations=True)
    assert (
        kernel_choice.int8_tiles(
            int8_model, emulated_tiles, replace(options, int8_activations=False), amx_cpu()
        )
        is None
    )
    assert (
        kernel_choice.int8_tiles(int8_model, emulated_tiles, options, this_cpu()) is None
    )  # no amx_int8 here
    assert (
        kernel_choice.int8_tiles(int8_model, load_for_cpu(), options, amx_cpu()) is None
    )  # no tiles granted
    assert (
        kernel_choice.int8_tiles(bf16_model, emulated_tiles, options, amx_cpu()) is None
    )  # nothing quantized
    assert count[0] == 0


@pytest.fixture(scope="module")
def emulated_as_own_build(emulated_tiles: Kernels) -> Kernels:
    """The emulated build under a name of its own: a build's custom ops are registered once per name
    (and process), and the real avx512bf16 build has that one."""
    library = ctypes.CDLL(str(emulated_tiles.path))
    return Kernels(library, replace(emulated_tiles.level, name="emulated_tiles"), emulated_tiles.path)


def test_int8_tiles_in_the_executor_give_the_vector_kernels_bits(int8_model, emulated_as_own_build) -> None:
    """The plan reaches every quantized projection and the head (fused layers, the decode stack and
    op by op), and tiled calls are the vector kernel's bits: the same logits for a prompt and the
    same tokens decoding three sequences together."""
    kernels = emulated_as_own_build
    shapes = kernel_choice.quantized_weights(int8_model)[0]
    plan = kernel_choice.Int8TilePlan(tuple((s, 1) for s in sorted(shapes)), "--cpu-kernels")
    tiled = CpuExecutor(int8_model, kernels, int8_activations=True, int8_plan=plan)
    vector = CpuExecutor(int8_model, kernels, int8_activations=True)
    assert "amx-int8 tiles from 1 rows" in tiled.choice.describe()
    assert tiled.fused is not None and tiled.kernels.head.kernel_weight.tile_rows == 1
    assert all(w.tile_rows == 1 for layer in tiled.fused for w in layer.kernel_weights.values())
    before = emulated_tile_products(kernels)
    prompt = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88, 7, 19, 23, 29, 31]  # a whole tile
    got = PagedRun(int8_model, step=tiled).step([("s", prompt)], all_logits=True)
    assert emulated_tile_products(kernels) > before
    want = PagedRun(int8_model, step=vector).step([("s", prompt)], all_logits=True)
    assert torch.equal(got, want)
    prompts = [prompt, prompt[3:9], [5, 6, 7, 8, 9, 10, 11]]
    assert greedy_batch(int8_model, prompts, 6, step=tiled) == greedy_batch(
        int8_model, prompts, 6, step=vector
    )
