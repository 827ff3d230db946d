"""Int8 activations on the amx build: per quantized weight shape, VPDPBUSD or AMX-INT8 tiles
(csrc/linear_int8.c), chosen by timing both at load.

NOTE: both give the same bits (exact integer sums, then the same fp32 scaling), so no row count
constrains the choice, unlike the bf16 linears' (`kernel_choice.py`): per shape, tiles from the
smallest timed row count at which they, and at every larger one, beat VPDPBUSD by MARGIN, cached
beside the bf16 choice (`kernel_cache.py`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.backends.cpu.build import build_id
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernel_cache import (
    CACHE_VERSION,
    key_of,
    read_entry,
    timings_json,
    write_entry,
)
from tandem.decoder.backends.cpu.kernel_options import AUTO, KernelOptions
from tandem.decoder.backends.cpu.kernel_timing import (
    MIN_MEASURED_BYTES,
    Binder,
    linear_weights,
    measure,
    projections,
)
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.backends.cpu.linear import QuantLinear
from tandem.decoder.backends.cpu.linear_plan import MARGIN, Shape, Timing, grouped, shape_name

log = logging.getLogger(__name__)

INT8_VECTOR = "vpdpbusd"  # int8 activations: linear_int8.c's vector kernel (every build with VNNI)
INT8_TILES = "amx-int8"  # int8 activations: its AMX-INT8 tiles (the amx build, tiles granted)


@dataclass(frozen=True)
class Int8TilePlan:
    """From which row count each quantized weight shape's int8-activation calls tile (absent: never)."""

    tile_rows: tuple[tuple[Shape, int], ...]
    source: str = field(compare=False)  # "measured", "cached" or "--cpu-kernels"
    timings: tuple[Timing, ...] = field(default=(), compare=False)

    def as_map(self) -> dict[Shape, int]:
        return dict(self.tile_rows)

    def describe(self) -> str:
        if not self.tile_rows:
            return f"int8 activations on {INT8_VECTOR} ({self.source})"
        by_rows: dict[int, list[str]] = {}
        for shape, rows in self.tile_rows:
            by_rows.setdefault(rows, []).append(shape_name(shape))
        tiles = ", ".join(
            f"from {rows} rows ({' '.join(shapes)})" for rows, shapes in sorted(by_rows.items())
        )
        return f"int8 activations on {INT8_TILES} tiles {tiles}, else {INT8_VECTOR} ({self.source})"


def decide_int8_tiles(
    timings: Sequence[Timing], shapes: Iterable[Shape], source: str = "measured"
) -> Int8TilePlan:
    """Per shape, the smallest timed row count from which the tiles beat the vector kernel by MARGIN at
    that count and every larger one (pure: the tests give it made-up times). A cell either kernel lacks
    counts against the tiles."""
    best = {(t.shape, t.rows, t.kernel): t.seconds for t in timings}
    chosen = []
    for shape in sorted(set(shapes)):
        buckets = sorted({t.rows for t in timings if t.shape == shape})
        wins = [
            best.get((shape, rows, INT8_TILES), math.inf) * MARGIN < best.get((shape, rows, INT8_VECTOR), 0.0)
            for rows in buckets
        ]
        start = next((i for i in range(len(buckets)) if all(wins[i:])), None)
        if start is not None:
            chosen.append((shape, buckets[start]))
    return Int8TilePlan(tuple(chosen), source, tuple(timings))


def quantized_weights(model: torch.nn.Module) -> tuple[dict[Shape, int], dict[Shape, QuantizedTensor]]:
    """The quantized linears one step calls, by shape: how many, and one real weight of each. A shape
    some bf16 linear also has is left out: the executor's per-shape tile_rows reaches both, and a bf16
    weight must never take a row count measured for int8 (its tiles are exact only from 1 row or
    past every step without prompt rows)."""
    counts: dict[Shape, int] = {}
    weights: dict[Shape, QuantizedTensor] = {}
    for weight in [getattr(linear, "qweight", None) for linear in projections(model)] + [model.head_weight]:
        if isinstance(weight, QuantizedTensor):
            shape = (weight.n, weight.k)
            counts[shape] = counts.get(shape, 0) + 1
            weights.setdefault(shape, weight)
    bf16, _, _ = linear_weights(model)
    return {s: n for s, n in counts.items() if s not in bf16}, {
        s: w for s, w in weights.items() if s not in bf16
    }


def int8_tiles(
    model: torch.nn.Module, kernels: Kernels | None, options: KernelOptions, cpu: CpuInfo | None = None
) -> Int8TilePlan | None:
    """Where a model's quantized linears run their int8 activations on AMX-INT8 tiles: None when the
    question does not arise (no int8 activations, no quantized weight, a build without the tiles or a
    CPU without amx_int8); else measured (bf16 models whose quantized weights hold 16 MiB or more),
    cached, or by --cpu-kernels (amx: tiles for every call; another build has none)."""
    cpu = cpu or this_cpu()
    if not options.int8_activations or kernels is None or not kernels.tiles or "amx_int8" not in cpu.flags:
        return None
    counts, weights = quantized_weights(model)
    if not counts:
        return None
    if options.kernels != AUTO:
        return Int8TilePlan(tuple((s, 1) for s in sorted(counts)), "--cpu-kernels")
    if model.config.dtype != torch.bfloat16:
        return Int8TilePlan((), "not measured: float32 activations")
    if sum(
        n * w.n * w.k * w.bits // 8 for (s, n), w in zip(counts.items(), weights.values(), strict=True)
    ) < (MIN_MEASURED_BYTES):
        return Int8TilePlan((), "not measured: a small model")
    buckets = {s: options.int8_buckets for s in counts}
    key = int8_cache_key(cpu, kernels, counts, weights, buckets)
    cached = _read_int8_plan(read_entry(options.cache_dir, key), set(counts))
    if cached is not None:
        log.info("CPU kernels for %s: %s, cached in %s", cpu.model_name, cached.describe(), options.cache_dir)
        return cached
    started = time.perf_counter()

    def binder(tile_rows: int) -> Binder:
        return lambda w: QuantLinear(
            kernels, kernels.quantized_weight(w, 0, True, tile_rows), None, torch.bfloat16
        )

    binders = {INT8_VECTOR: binder(0), INT8_TILES: binder(1)}
    # Both kept at every row count: the tiles run whole tiles of 16 rows only (fewer rows are the
    # vector kernel's work), so they cannot be judged by their smallest calls.
    timings = measure(binders, weights, buckets, (), options.exact_rows, (INT8_VECTOR, INT8_TILES))
    plan = decide_int8_tiles(timings, counts)
    log.info("CPU kernels for %s [%s], %d threads, int8 activations measured in %.1f s: %s\n%s",
             cpu.model_name, cpu.isa_summary, torch.get_num_threads(), time.perf_counter() - started,
             plan.describe(), _int8_table(plan))  # fmt: skip
    write_entry(
        options.cache_dir,
        key,
        {"tile_rows": [[*s, rows] for s, rows in plan.tile_rows], "timings": timings_json(plan.timings)},
    )
    return plan


def int8_cache_key(
    cpu: CpuInfo,
    kernels: Kernels,
    counts: Mapping[Shape, int],
    weights: Mapping[Shape, QuantizedTensor],
    buckets: Mapping[Shape, Sequence[int]],
) -> str:
    """What a cached int8 choice must have been measured with: this CPU, this build (its id; the tiles
    granted or not), these shapes in these formats at these row counts, these threads."""
    facts = {
        "int8": [INT8_VECTOR, INT8_TILES],
        "cpu": cpu.model_name,
        "isa": cpu.isa_summary,
        "build": [build_id(kernels.level), kernels.tiles],
        "shapes": sorted([*s, counts[s], _format(weights[s]), *buckets[s]] for s in counts),
        "threads": torch.get_num_threads(),
        "version": CACHE_VERSION,
    }
    return key_of(facts)


def _format(weight: QuantizedTensor) -> str:
    """What the tiles' cost depends on beside the shape: Q4 with offsets adds a multiply-add a block."""
    return "q8" if weight.bits == 8 else ("q4_1" if weight.mins is not None else "q4_0")


def _read_int8_plan(entry: dict | None, shapes: set[Shape]) -> Int8TilePlan | None:
    """A cached int8 plan, or None (none, or not one this code wrote: measured again and rewritten)."""
    if entry is None:
        return None
    try:
        tile_rows = tuple(((int(n), int(k)), rows) for n, k, rows in entry["tile_rows"])
        timings = tuple(Timing(kernel, (n, k), rows, s) for kernel, n, k, rows, s in entry["timings"])
    except (ValueError, KeyError, TypeError):
        return None
    if any(type(rows) is not int or rows < 1 or shape not in shapes for shape, rows in tile_rows):
        return None
    return Int8TilePlan(tile_rows, "cached", timings)


def _int8_table(plan: Int8TilePlan) -> str:
    chosen = plan.as_map()
    lines = []
    for (shape, rows), timings in grouped(plan.timings).items():
        pick = INT8_TILES if shape in chosen and rows >= chosen[shape] else INT8_VECTOR
        cells = ", ".join(
            f"{t.kernel}{'*' if t.kernel == pick else ''} {t.seconds * 1e3:.3f}"
            for t in sorted(timings, key=lambda t: t.seconds)
        )
        lines.append(f"  {shape_name(shape):>11} x {rows:>4} rows: {cells} ms")
    return "\n".join(lines)
