"""Int8 activations' kernel per quantized shape (backends/cpu/int8_tile_choice.py): VPDPBUSD or AMX-INT8
tiles from made-up timings, measured once then cached, named by --cpu-kernels, not asked where it
does not arise, and tiled calls giving the vector kernel's bits in the executor."""

from __future__ import annotations

import ctypes
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem.common.torch_part.quantized_tensor import quantize
from tandem.decoder.backends.cpu import int8_tile_choice
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.int8_tile_choice import INT8_TILES as TILES
from tandem.decoder.backends.cpu.int8_tile_choice import INT8_VECTOR as VECTOR
from tandem.decoder.backends.cpu.int8_tile_choice import Int8TilePlan, decide_int8_tiles, int8_tiles
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernel_cache import CACHE_FILE
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cpu.kernels import Kernels, load_for_cpu
from tandem.decoder.backends.cpu.linear_plan import Shape, Timing
from tandem.decoder.models import quantized
from tandem.decoder.models.loader import load_model

from ...conftest import Checkpoint
from ...models.helpers import PagedRun, greedy_batch
from .conftest import emulated_tile_products

QKV = (960, 576)
OPTIONS = KernelOptions(exact_rows=68, max_rows=2048)  # int8 buckets 1, 4, 16, 32, 128, 512


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
    monkeypatch.setattr(int8_tile_choice, "MIN_MEASURED_BYTES", 0)

    def fake(binders, weights, buckets, prefill_only, exact_rows, keep=(), clock=None):
        count[0] += 1
        assert set(binders) == {VECTOR, TILES} and set(keep) == {VECTOR, TILES}  # neither pruned
        return [
            Timing(kernel, shape, rows, rows / (2.0 if kernel == TILES and rows >= 16 else 1.0))
            for shape, rs in buckets.items()
            for rows in rs
            for kernel in binders
        ]

    monkeypatch.setattr(int8_tile_choice, "measure", fake)
    return count


def test_int8_tiles_are_measured_once_then_cached_and_cpu_kernels_amx_tiles_every_call(
    int8_model, emulated_tiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = tiles_from_16(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, cache_dir=tmp_path, int8_activations=True)
    shapes = set(int8_tile_choice.quantized_weights(int8_model)[0])
    first = int8_tiles(int8_model, emulated_tiles, options, amx_cpu())
    assert count[0] == 1 and first is not None and first.source == "measured"
    assert first.as_map() == dict.fromkeys(shapes, 16)
    second = int8_tiles(int8_model, emulated_tiles, options, amx_cpu())
    assert count[0] == 1 and second == first and second.source == "cached"
    # An entry this code did not write (a row count of 0) is measured again and rewritten.
    cache = tmp_path / CACHE_FILE
    written = json.loads(cache.read_text())
    for entry in written["entries"].values():
        entry["tile_rows"] = [[n, k, 0] for n, k, _ in entry["tile_rows"]]
    cache.write_text(json.dumps(written))
    third = int8_tiles(int8_model, emulated_tiles, options, amx_cpu())
    assert count[0] == 2 and third == first and third.source == "measured"
    named = replace(options, kernels="amx")
    assert int8_tiles(int8_model, emulated_tiles, named, amx_cpu()).as_map() == dict.fromkeys(shapes, 1)
    assert count[0] == 2  # the override times nothing


def test_no_int8_tile_choice_without_the_mode_the_tiles_or_amx_int8(
    int8_model, bf16_model, emulated_tiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = tiles_from_16(monkeypatch)
    options = KernelOptions(exact_rows=16, max_rows=256, int8_activations=True)
    assert int8_tiles(int8_model, emulated_tiles, replace(options, int8_activations=False), amx_cpu()) is None
    assert int8_tiles(int8_model, emulated_tiles, options, this_cpu()) is None  # no amx_int8 here
    assert int8_tiles(int8_model, load_for_cpu(), options, amx_cpu()) is None  # no tiles granted
    assert int8_tiles(bf16_model, emulated_tiles, options, amx_cpu()) is None  # nothing quantized
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
    shapes = int8_tile_choice.quantized_weights(int8_model)[0]
    plan = Int8TilePlan(tuple((s, 1) for s in sorted(shapes)), "--cpu-kernels")
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
