"""The measured choice cached beside the model (backends/cpu/kernel_cache.py): a second start times
nothing; another CPU, build or model times again; and a cache file written before kernel_choice.py
was split (kernel_cache_pre_split.json) is still read, and written byte for byte alike."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tandem.decoder.backends.cpu import int8_tile_choice, kernel_cache, kernel_choice
from tandem.decoder.backends.cpu.build import levels_for
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernel_cache import CACHE_FILE
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cpu.kernels import load_for_cpu

from .fake_measure import counted_measure


def test_a_second_start_reads_the_cached_choice_and_times_nothing(
    bf16_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    count = counted_measure(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, cache_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=kernel_choice.log.name):
        kernels, first = kernel_choice.choose(bf16_model, options)
    assert count[0] == 1 and first is not None and first.source == "measured"
    assert kernels is not None and kernels.level.name == first.level == load_for_cpu().level.name
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())["entries"]) == 1
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
        monkeypatch.setattr(kernel_cache, "build_id", lambda level: "0123456789abcdef")
    else:
        options = KernelOptions(exact_rows=8, max_rows=256, cache_dir=tmp_path)  # other row buckets
    kernel_choice.choose(bf16_model, options, cpu)
    assert count[0] == 2
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())["entries"]) == 2


# -- a cache written before the split -------------------------------------------------------------------

PRE_SPLIT = Path(__file__).with_name("kernel_cache_pre_split.json")
# A made-up CPU whose flags run the x86_64 and avx2 builds, and grant AMX-INT8 to the int8 choice.
FLAGS = "avx avx2 bmi1 bmi2 f16c fma abm movbe xsave amx_int8"
CPU = CpuInfo("x86_64", "a made-up CPU", frozenset(FLAGS.split()))
HEAD = (256, 32)
BF16_COUNTS = {(64, 32): 8, (128, 32): 4, HEAD: 1}
INT8_COUNTS = {(96, 64): 4}
SPLIT = (kernel_choice, kernel_cache, int8_tile_choice)  # where the cache's facts are read now
# Speeds, the time a call's rows times its output features: avx2 twice x86_64's, oneDNN twice avx2's
# on prefill chunks, AMX-INT8 twice VPDPBUSD's from 16 rows.
SPEED = {"x86_64": 1.0, "avx2": 2.0, "onednn": 4.0, "vpdpbusd": 1.0, "amx-int8": 2.0}


def load_and_choose(
    monkeypatch: pytest.MonkeyPatch, directory: Path, choice: ModuleType, cache: ModuleType, int8: ModuleType
) -> tuple[object, object, list[list[str]]]:
    """choose and int8_tiles on CPU for made-up linears, every fact a cache key holds fixed (the builds'
    ids, the threads, torch's version) and measure made up; returns both plans and the candidates of
    each measurement. `choice`, `cache` and `int8` are the modules that read those facts: after the
    split kernel_choice, kernel_cache and int8_tile_choice; before it, kernel_choice for all three
    (the file beside this one was written so, by kernel_choice.py at ea7d5d90)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    monkeypatch.setattr(choice, "load", lambda level: SimpleNamespace(level=level, tiles=False))
    monkeypatch.setattr(choice, "has_onednn_bf16", lambda: True)
    bf16_weights = dict.fromkeys(BF16_COUNTS)  # never bound: measure is made up
    monkeypatch.setattr(choice, "linear_weights", lambda model: (BF16_COUNTS, bf16_weights, HEAD))
    int8_weights = {s: SimpleNamespace(n=s[0], k=s[1], bits=4, mins=None) for s in INT8_COUNTS}
    monkeypatch.setattr(int8, "quantized_weights", lambda model: (INT8_COUNTS, int8_weights))
    for module in (choice, cache, int8):
        monkeypatch.setattr(module, "build_id", lambda level: f"id-of-{level.name}", raising=False)
        monkeypatch.setattr(module, "MIN_MEASURED_BYTES", 0, raising=False)
    measured: list[list[str]] = []

    def fake(binders, weights, buckets, prefill_only, exact_rows, keep=(), clock=None):
        measured.append(sorted(binders))
        return [
            cache.Timing(kernel, shape, rows, rows * shape[0] * 1e-9 / speed)
            for shape, rs in buckets.items()
            for rows in rs
            for kernel in binders
            if rows > exact_rows or kernel not in prefill_only
            for speed in [SPEED[kernel] if kernel != "amx-int8" or rows >= 16 else 1.0]
        ]

    monkeypatch.setattr(choice, "measure", fake)
    monkeypatch.setattr(int8, "measure", fake)
    model = SimpleNamespace(config=SimpleNamespace(dtype=torch.bfloat16), tp=None, modules=lambda: [])
    options = cache.KernelOptions(exact_rows=16, max_rows=256, cache_dir=directory, int8_activations=True)
    _, plan = choice.choose(model, options, CPU)
    tiles = SimpleNamespace(level=levels_for("x86_64")[-1], tiles=True)
    return plan, int8.int8_tiles(model, tiles, options, CPU), measured


def test_a_cache_written_before_the_split_is_read_and_nothing_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / CACHE_FILE).write_bytes(PRE_SPLIT.read_bytes())
    plan, int8_plan, measured = load_and_choose(monkeypatch, tmp_path, *SPLIT)
    assert measured == [] and plan is not None and int8_plan is not None
    assert plan.source == "cached" and int8_plan.source == "cached"
    assert plan.level == "avx2" and {k for _, k in plan.exact} == {"avx2"}
    assert plan.prefill_of(HEAD) == "avx2" and plan.onednn_shapes == {(64, 32), (128, 32)}
    assert int8_plan.as_map() == {(96, 64): 16}
    # The timings behind each: 2 builds x 3 shapes x rows 1, 4, 16, and 3 candidates x 2 shapes x 128,
    # 256 rows; 2 int8 kernels x 5 row counts.
    assert len(plan.timings) == 2 * 3 * 3 + 3 * 2 * 2 and len(int8_plan.timings) == 2 * 5


def test_the_cache_file_is_written_byte_for_byte_as_before_the_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, int8_plan, measured = load_and_choose(monkeypatch, tmp_path, *SPLIT)
    assert measured == [["avx2", "onednn", "x86_64"], ["amx-int8", "vpdpbusd"]]
    assert (tmp_path / CACHE_FILE).read_bytes() == PRE_SPLIT.read_bytes()
