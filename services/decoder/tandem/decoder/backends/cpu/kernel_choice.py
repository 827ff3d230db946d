"""Which kernel runs each bf16 linear, chosen by timing the candidates on this CPU at load.

NOTE: the rule. A CPU's flags say which builds may run (`isa.py`); which is fastest is measured. For
the model's real linear shapes and the row counts the engine will call them with, every candidate
this CPU runs is timed (interleaved, best of a few) and the fastest bound, under one constraint: a
row's bits must not depend on how many rows share its call, for every call a decode or verify step
can make. So:

- rows below `prefill_rows` (every step without prompt positions fits: decode, speculation's
  verification, batched decode): one exact kernel per shape for all of them, the one whose times
  over the row buckets are best on the whole (geometric mean against each bucket's fastest). Exact
  kernels keep a row's summation order whatever the row count: the C builds' own ("amx" tiles,
  "avx512bf16", "avx512", "avx2", "x86_64"). Kernels of different builds cannot share a step (a
  fused layer is one library's), so one build is chosen for the model and, within the amx build,
  tiles or VDPBF16PS per shape.
- prefill chunks of `prefill_rows` rows or more (larger than any step without prompt rows): per
  shape, the fastest of the chosen build's kernels and oneDNN's packed linear, which re-blocks a
  row's sums by the row count. That changes one promise, which the default mode already makes for
  bf16 (a prefix-cache hit may round differently from a fresh prefill): a prompt's hidden rows may
  differ in their last bits with the chunk's size. Decode and verify rows never take such a kernel:
  a step mixing them with a large chunk is split (`prefill_split.py`), and `--batch-invariant` keeps
  every call on the exact kernels.

A kernel becomes the choice only if it beats the default (the highest build's own kernel, what the
flags alone chose before) by `MARGIN` (a prefill-only kernel by `PREFILL_MARGIN`): on a shared
machine a few percent is noise, and a switch must pay for itself. The choice is cached as JSON
beside the model, keyed by the CPU's model name, the builds' ids, the shapes, the row buckets and the
thread count, so a second start measures nothing.
`--cpu-kernels <build>` skips the measurement and runs that build's kernel for every call.

Quantized weights with int8 activations (--quantized-activations int8) have a choice of their own on
the amx build: VPDPBUSD or AMX-INT8 tiles (csrc/linear_int8.c). Both give the same bits (exact
integer sums, then the same fp32 scaling), so no row count constrains it: per shape, tiles from the
smallest timed row count at which they, and at every larger one, beat VPDPBUSD by MARGIN
(`int8_tiles`, cached beside the bf16 choice).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.client.errors import ConfigError
from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.backends.cpu.build import Level, build_id, levels_for
from tandem.decoder.backends.cpu.isa import CpuInfo, runnable_levels, this_cpu
from tandem.decoder.backends.cpu.kernels import Kernels, KernelsUnavailable, load, load_for_cpu
from tandem.decoder.backends.cpu.linear import CLinear, PackedLinear, QuantLinear, has_onednn_bf16

log = logging.getLogger(__name__)

AUTO = "auto"
ONEDNN = "onednn"  # oneDNN's packed bf16 linear: a prefill-only candidate
TILES = "amx"  # the amx build's AMX tiles; the amx build also runs "avx512bf16" (VDPBF16PS)
# --cpu-kernels: auto, or one build's kernel for every call (the builds of every architecture).
CPU_KERNELS = (AUTO, "x86_64", "avx2", "avx512", "avx512bf16", TILES, "aarch64", "generic")
MARGIN = 1.05  # a kernel replaces the default only when this much faster (geometric mean)
# A prefill-only kernel must pay for more: a step mixing decode rows with a chunk is then split, and
# the decode rows' sub-step reads every weight a second time.
PREFILL_MARGIN = 1.25
PRUNE = 2.5  # a build this much slower than the best at a row bucket is not timed at larger ones
SAMPLE_S = 5e-5  # each timed sample repeats a call until it lasts about this long
ROUNDS = 5  # samples per (candidate, shape, rows), interleaved; the best is kept
# A model whose bf16 linears hold less than this is not measured (the highest build's kernels): its
# step's linears take tens of microseconds on any kernel, and the measurement would cost more than it
# could ever save (the tests' tiny checkpoints are such models).
MIN_MEASURED_BYTES = 16 << 20
INT8_VECTOR = "vpdpbusd"  # int8 activations: linear_int8.c's vector kernel (every build with VNNI)
INT8_TILES = "amx-int8"  # int8 activations: its AMX-INT8 tiles (the amx build, tiles granted)
CACHE_FILE = "cpu-kernels.json"
CACHE_VERSION = 1

Shape = tuple[int, int]  # a linear's weight: (out_features, in_features)
_T = TypeVar("_T")


@dataclass(frozen=True)
class KernelOptions:
    """How the engine wants its CPU kernels chosen; built from EngineConfig (`kernel_options`)."""

    kernels: str = AUTO  # --cpu-kernels: "auto" (measured) or a build's name
    exact_rows: int = 64  # the most rows a step without prompt positions holds (decode, verify)
    max_rows: int = 2048  # the step's token budget: the largest prefill chunk
    prefill_kernels: bool = True  # may prefill chunks take a kernel of their own (not --batch-invariant)
    cache_dir: Path | None = None  # where the measured choice is cached (the model's directory); None: not
    # Quantized linears: each decode or verify row's inputs rounded to int8 (--quantized-activations)
    int8_activations: bool = False

    @property
    def prefill_rows(self) -> int:
        """Calls of this many rows on are prefill chunks (every step without prompt rows is smaller)."""
        return self.exact_rows + 1

    @property
    def exact_buckets(self) -> tuple[int, ...]:
        """The row counts the exact kernels are timed at: one row, 4, 16, and the largest step without
        prompt rows up to 32 (past it the kernels' time per row no longer changes, and the LM head's
        calls would take most of the measurement)."""
        top = min(self.exact_rows, 32)
        return tuple(sorted({1, *(r for r in (4, 16) if r < top), top}))

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prefill chunk sizes timed: just past the exact rows (128 at least), and a long chunk
        (512, or the budget)."""
        if not self.prefill_kernels or self.max_rows < self.prefill_rows:
            return ()
        short = max(self.prefill_rows, 128)
        return tuple(sorted({min(short, self.max_rows), min(max(short, 512), self.max_rows)}))

    @property
    def int8_buckets(self) -> tuple[int, ...]:
        """The row counts the int8 kernels are timed at: the exact buckets and the prefill chunks',
        these whether or not prefill chunks may take a kernel of their own (both int8 kernels are
        exact)."""
        short = max(self.prefill_rows, 128)
        chunks = {min(short, self.max_rows), min(max(short, 512), self.max_rows)}
        return tuple(sorted({*self.exact_buckets, *(c for c in chunks if c > self.exact_rows)}))


@dataclass(frozen=True)
class Timing:
    """One candidate's best time for one shape at one row count."""

    kernel: str  # a build's name, TILES or ONEDNN
    shape: Shape
    rows: int
    seconds: float


@dataclass(frozen=True)
class LinearPlan:
    """What runs each bf16 linear: the build to load and, per weight shape, its exact and prefill kernels."""

    level: str  # the build the executor loads (its fused layers, decode stack and attention)
    exact: tuple[tuple[Shape, str], ...]  # per shape: the kernel of every call below prefill_rows rows
    prefill: tuple[tuple[Shape, str], ...]  # per shape: the kernel of calls of prefill_rows rows or more
    prefill_rows: int
    source: str = field(compare=False)  # "measured", "cached" or "--cpu-kernels"
    timings: tuple[Timing, ...] = field(default=(), compare=False)  # what the choice was made from

    def exact_of(self, shape: Shape) -> str:
        return dict(self.exact).get(shape, self.level)

    def prefill_of(self, shape: Shape) -> str:
        return dict(self.prefill).get(shape, self.exact_of(shape))

    def tile_rows(self, shape: Shape) -> int:
        """Kernels.pack_weight's tile_rows for a weight of this shape: 1 when the tiles are its exact
        kernel, prefill_rows when only its prefill chunks tile, else 0."""
        if self.exact_of(shape) == TILES:
            return 1
        return self.prefill_rows if self.prefill_of(shape) == TILES else 0

    @property
    def splits_prefill(self) -> bool:
        """Whether some prefill chunk runs another kernel than decode rows (mixed steps then split)."""
        return any(kernel != self.exact_of(shape) for shape, kernel in self.prefill)

    @property
    def onednn_shapes(self) -> frozenset[Shape]:
        return frozenset(shape for shape, kernel in self.prefill if kernel == ONEDNN)

    def describe(self) -> str:
        """One line: the build, then the kernels of the exact calls and, where they differ, of prefill."""
        exact = _tally(self.exact)
        prefill = _tally((s, k) for s, k in self.prefill if k != self.exact_of(s))
        line = f"{self.level} build ({self.source}); linears {exact}"
        return line + (f"; prefill chunks of {self.prefill_rows}+ rows: {prefill}" if prefill else "")

    def table(self) -> str:
        """The timings behind the choice, a line per shape and row count, the chosen kernel marked."""
        lines = []
        for (shape, rows), timings in _grouped(self.timings).items():
            chosen = self.exact_of(shape) if rows < self.prefill_rows else self.prefill_of(shape)
            cells = ", ".join(
                f"{t.kernel}{'*' if t.kernel == chosen else ''} {t.seconds * 1e3:.3f}"
                for t in sorted(timings, key=lambda t: t.seconds)
            )
            lines.append(f"  {_name(shape):>11} x {rows:>4} rows: {cells} ms")
        return "\n".join(lines)


def _tally(kernels: Iterable[tuple[Shape, str]]) -> str:
    by_kernel: dict[str, list[str]] = {}
    for shape, kernel in kernels:
        by_kernel.setdefault(kernel, []).append(_name(shape))
    return ", ".join(f"{kernel} ({' '.join(shapes)})" for kernel, shapes in sorted(by_kernel.items()))


def _name(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def _grouped(timings: Iterable[Timing]) -> dict[tuple[Shape, int], list[Timing]]:
    groups: dict[tuple[Shape, int], list[Timing]] = {}
    for t in timings:
        groups.setdefault((t.shape, t.rows), []).append(t)
    return groups


@dataclass(frozen=True)
class Family:
    """Kernels one build runs, which may therefore share a model: the amx build runs tiles and
    VDPBF16PS; every other build its own kernel."""

    level: str
    kernels: tuple[str, ...]


def decide(
    timings: Sequence[Timing],
    counts: Mapping[Shape, int],  # how many linears of each shape one step calls
    families: Sequence[Family],  # the default (the highest build) first, its kernels default first
    options: KernelOptions,
    prefill_candidates: Sequence[str] = (),  # beside the chosen build's kernels: ONEDNN where it runs
    source: str = "measured",
) -> LinearPlan:
    """The plan from measured times (pure: the tests give it made-up ones).

    A kernel's cost over some shapes and row buckets is the median, over those (shape, rows) cells,
    of log(its time / the fastest candidate's time there): each cell counts alike whatever its size,
    and one cell a neighbour's load slowed (a descheduled thread costs a sample milliseconds) cannot
    move it. A cell a kernel lacks (pruned, or not measured) costs infinity."""
    best = {(t.shape, t.rows, t.kernel): t.seconds for t in timings}
    fastest: dict[tuple[Shape, int], float] = {}
    for t in timings:
        fastest[t.shape, t.rows] = min(fastest.get((t.shape, t.rows), math.inf), t.seconds)
    shapes = sorted(counts)

    def cost(kernel_of: Callable[[Shape], str], of: Sequence[Shape], buckets: Sequence[int]) -> float:
        cells = [
            math.log(best[s, rows, kernel_of(s)] / fastest[s, rows])
            if (s, rows, kernel_of(s)) in best and fastest[s, rows] > 0
            else math.inf
            for s in of
            for rows in buckets
        ]
        return statistics.median(cells) if cells else 0.0

    def faster_everywhere(kernel: str, than: str, s: Shape, buckets: Sequence[int]) -> bool:
        return all(best.get((s, r, kernel), math.inf) < best.get((s, r, than), math.inf) for r in buckets)

    exact_buckets, prefill_buckets = options.exact_buckets, options.prefill_buckets
    plans = [
        (
            family,
            {s: _pick(family.kernels, lambda k, s=s: cost(lambda _: k, [s], exact_buckets)) for s in shapes},
        )
        for family in families
    ]
    family, exact = plans[
        _pick(range(len(plans)), lambda i: cost(lambda s: plans[i][1][s], shapes, exact_buckets))
    ]
    # A prefill-only kernel must also be the faster at every chunk size: two cells are few for a
    # median, and one slowed sample of the exact kernel must not split every mixed step for nothing.
    prefill = {
        s: _pick(
            (exact[s], *(k for k in (*family.kernels, *prefill_candidates) if k != exact[s])),
            lambda k, s=s: (
                cost(lambda _: k, [s], prefill_buckets)
                if k == exact[s] or faster_everywhere(k, exact[s], s, prefill_buckets)
                else math.inf
            ),
            PREFILL_MARGIN,
        )
        if prefill_buckets
        else exact[s]
        for s in shapes
    }
    return LinearPlan(
        level=family.level,
        exact=tuple(sorted(exact.items())),
        prefill=tuple(sorted(prefill.items())),
        prefill_rows=options.prefill_rows,
        source=source,
        timings=tuple(timings),
    )


def _pick(candidates: Sequence[_T], cost: Callable[[_T], float], margin: float = MARGIN) -> _T:
    """The first candidate (the default), unless another's cost is lower by log(margin)."""
    pick, pick_cost = candidates[0], cost(candidates[0])
    for candidate in candidates[1:]:
        c = cost(candidate)
        if c < pick_cost - math.log(margin):
            pick, pick_cost = candidate, c
    return pick


# -- measuring ----------------------------------------------------------------------------------------

Bound = Callable[[torch.Tensor], torch.Tensor]  # a linear bound to one weight: x [rows, k] -> [rows, n]
Binder = Callable[[Any], Bound]  # a candidate: binds a weight [n, k] (bf16, or a QuantizedTensor)


def measure(
    binders: Mapping[str, Binder],
    weights: Mapping[Shape, Any],  # one real weight of each shape [n, k] (bf16, or a QuantizedTensor)
    buckets: Mapping[Shape, Sequence[int]],  # the row counts each shape is timed at
    prefill_only: Iterable[str],  # candidates timed only past exact_rows
    exact_rows: int,
    keep: Iterable[str] = (),  # never pruned: the default build's kernels
    clock: Callable[[], float] = time.perf_counter,
) -> list[Timing]:
    """Each candidate's best time per (shape, rows), row counts ascending, candidates interleaved
    within each (shape, rows) so that a neighbour's load falls on all of them alike. After each row
    count up to exact_rows, a candidate PRUNE times slower than the fastest on every shape is not
    timed again: it cannot win, and its larger calls would take most of the measurement."""
    prefill_only, keep = frozenset(prefill_only), frozenset(keep)
    alive = list(binders)
    bound: dict[tuple[str, Shape], Bound] = {}
    timings: list[Timing] = []
    for rows in sorted({r for rs in buckets.values() for r in rs}):
        kernels = [k for k in alive if rows > exact_rows or k not in prefill_only]
        ratios: dict[str, float] = dict.fromkeys(kernels, math.inf)  # its smallest time / the fastest's
        for shape in sorted(s for s, rs in buckets.items() if rows in rs):
            x = torch.randn(rows, shape[1]).to(torch.bfloat16)  # [rows, in_features]
            calls = []
            for kernel in kernels:
                if (kernel, shape) not in bound:
                    bound[kernel, shape] = binders[kernel](weights[shape])
                calls.append(bound[kernel, shape])
            seconds = _best_times(calls, x, clock)
            for kernel, s in zip(kernels, seconds, strict=True):
                timings.append(Timing(kernel, shape, rows, s))
                ratios[kernel] = min(ratios[kernel], s / min(seconds))
        if rows <= exact_rows:
            alive = [k for k in alive if k in keep or ratios.get(k, 0.0) < PRUNE]
            for key in [key for key in bound if key[0] not in alive]:
                del bound[key]  # its packed copies go now
    return timings


def _best_times(calls: Sequence[Bound], x: torch.Tensor, clock: Callable[[], float]) -> list[float]:
    """Seconds per call of each, the best of ROUNDS samples taken in turn, each sample repeating the
    call until it lasts about SAMPLE_S (a one-row call of a small weight takes microseconds). Short
    samples and many of them: on a shared machine a thread descheduled mid-call costs that sample a
    scheduler slice (milliseconds), and the best of several short samples misses it."""
    reps = []
    for call in calls:
        start = clock()
        call(x)  # allocates scratch and brings the weight into cache: slower than the rest, if anything
        reps.append(max(1, min(1000, int(SAMPLE_S / max(clock() - start, 1e-7)))))
    best = [math.inf] * len(calls)
    for _ in range(ROUNDS):
        for i, call in enumerate(calls):
            start = clock()
            for _ in range(reps[i]):
                call(x)
            best[i] = min(best[i], (clock() - start) / reps[i])
    return best


# -- the choice at load ---------------------------------------------------------------------------------


def linear_weights(
    model: torch.nn.Module,
) -> tuple[dict[Shape, int], dict[Shape, torch.Tensor], Shape | None]:
    """The bf16 linears one step calls, by shape: how many, one real weight of each, and the head's
    shape (its calls have a row per sampled position, never a prefill chunk's rows)."""
    counts: dict[Shape, int] = {}
    weights: dict[Shape, torch.Tensor] = {}

    def add(weight: object) -> Shape | None:
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return None
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        counts[shape] = counts.get(shape, 0) + 1
        weights.setdefault(shape, weight.detach().contiguous())
        return shape

    for linear in projections(model):
        add(getattr(linear, "weight", None))
    head = add(model.head_weight)
    return counts, weights, head


def projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every layer's four projections (qkv, o, gate_up, down), layer by layer."""
    return [
        linear
        for layer in model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]


def choose(
    model: torch.nn.Module, options: KernelOptions, cpu: CpuInfo | None = None
) -> tuple[Kernels | None, LinearPlan | None]:
    """The build to load and the plan for the model's bf16 linears (None: no bf16 linears to choose
    for, several ranks, or no build: the executor then chooses as the flags say). Raises ValueError
    naming --cpu-kernels when the build it names cannot run here."""
    cpu = cpu or this_cpu()
    if options.kernels != AUTO:
        return _override(model, options, cpu)
    loaded = _loadable(runnable_levels(cpu))
    if not loaded:
        return load_for_cpu(cpu), None  # None, said in one warning
    top = loaded[-1]
    counts, weights, head = linear_weights(model)
    if model.config.dtype != torch.bfloat16 or model.tp is not None or not counts or _has_quantized(model):
        return top, None
    if sum(n * s[0] * s[1] * 2 for s, n in counts.items()) < MIN_MEASURED_BYTES:
        return top, None
    families = _families(loaded)
    prefill_candidates = (ONEDNN,) if options.prefill_buckets and has_onednn_bf16() else ()
    buckets = {s: options.exact_buckets + (() if s == head else options.prefill_buckets) for s in counts}
    key = _cache_key(cpu, loaded, counts, buckets, prefill_candidates)
    cached = _read_cache(options.cache_dir, key, options)
    if cached is not None:
        plan = cached
        # The table was logged when it was measured and is in the cache file: a start that measures
        # nothing says its choice in one line (30 lines a start were noise), the table at debug.
        log.info("CPU kernels for %s: %s, cached in %s", cpu.model_name, plan.describe(), options.cache_dir)
        log.debug("CPU kernels, the cached timings:\n%s", plan.table())
    else:
        started = time.perf_counter()
        binders = _binders(loaded, families)
        timings = measure(
            binders, weights, buckets, prefill_candidates, options.exact_rows, families[0].kernels
        )
        plan = decide(timings, counts, families, options, prefill_candidates)
        log.info("CPU kernels for %s [%s], %d threads, measured in %.1f s: %s\n%s", cpu.model_name,
                 cpu.isa_summary, torch.get_num_threads(), time.perf_counter() - started, plan.describe(),
                 plan.table())  # fmt: skip
        _write_cache(options.cache_dir, key, plan)
    return next(k for k in loaded if k.level.name == plan.level), plan


# -- int8 activations: VPDPBUSD or AMX-INT8 tiles -----------------------------------------------------


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
            by_rows.setdefault(rows, []).append(_name(shape))
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
    facts = {
        "int8": [INT8_VECTOR, INT8_TILES],
        "cpu": cpu.model_name,
        "isa": cpu.isa_summary,
        "build": [build_id(kernels.level), kernels.tiles],
        "shapes": sorted([*s, counts[s], _format(weights[s]), *buckets[s]] for s in counts),
        "threads": torch.get_num_threads(),
        "version": CACHE_VERSION,
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]
    cached = _read_int8_plan(_read_entry(options.cache_dir, key), set(counts))
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
    _write_entry(
        options.cache_dir,
        key,
        {"tile_rows": [[*s, rows] for s, rows in plan.tile_rows], "timings": _timings_json(plan.timings)},
    )
    return plan


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
    for (shape, rows), timings in _grouped(plan.timings).items():
        pick = INT8_TILES if shape in chosen and rows >= chosen[shape] else INT8_VECTOR
        cells = ", ".join(
            f"{t.kernel}{'*' if t.kernel == pick else ''} {t.seconds * 1e3:.3f}"
            for t in sorted(timings, key=lambda t: t.seconds)
        )
        lines.append(f"  {_name(shape):>11} x {rows:>4} rows: {cells} ms")
    return "\n".join(lines)


def _override(model: torch.nn.Module, options: KernelOptions, cpu: CpuInfo) -> tuple[Kernels, LinearPlan]:
    kernels = check_kernels(options.kernels, cpu)
    counts, _, _ = linear_weights(model)
    kernel_of = tuple((s, options.kernels) for s in sorted(counts))
    return kernels, LinearPlan(options.kernels, kernel_of, kernel_of, options.prefill_rows, "--cpu-kernels")


def check_kernels(name: str, cpu: CpuInfo | None = None) -> Kernels:
    """The build --cpu-kernels names, loaded; ConfigError (cpu_kernels) saying why it cannot run here."""
    cpu = cpu or this_cpu()
    runnable = runnable_levels(cpu)
    level = next((level for level in levels_for(cpu.machine) if level.name == name), None)
    if level is None or level not in runnable:
        needs = f" (it needs {' '.join(sorted(level.cpu_flags - cpu.flags))})" if level is not None else ""
        choices = ", ".join(level.name for level in runnable)
        raise ConfigError(
            "cpu_kernels", f": {name} cannot run on this CPU{needs}; it runs {choices} (or auto)"
        )
    try:
        kernels = load(level)
    except KernelsUnavailable as error:
        raise ConfigError("cpu_kernels", f": the {name} build cannot be loaded: {error}") from None
    if name == TILES and not kernels.tiles:
        raise ConfigError("cpu_kernels", ": amx: the kernel refused this process the tile state (arch_prctl)")
    return kernels


def _loadable(levels: Sequence[Level]) -> list[Kernels]:
    loaded = []
    for level in levels:
        try:
            loaded.append(load(level))
        except KernelsUnavailable as error:
            log.info("CPU kernels: the %s build is not a candidate: %s", level.name, error)
    return loaded


def _has_quantized(model: torch.nn.Module) -> bool:
    """Quantized projections run their own kernel, in the highest build: no build switch then."""
    return any(hasattr(module, "qweight") for module in model.modules())


def _families(loaded: Sequence[Kernels]) -> list[Family]:
    """The builds' kernel families, the highest build first; the amx build runs VDPBF16PS (its
    default) and, with the tile state granted, tiles, so the avx512bf16 build is no family of its own."""
    names = [k.level.name for k in loaded]
    families = []
    for kernels in reversed(loaded):
        name = kernels.level.name
        if name == TILES:
            families.append(Family(name, ("avx512bf16", TILES) if kernels.tiles else ("avx512bf16",)))
        elif not (name == "avx512bf16" and TILES in names):
            families.append(Family(name, (name,)))
    return families


def _binders(loaded: Sequence[Kernels], families: Sequence[Family]) -> dict[str, Binder]:
    by_name = {k.level.name: k for k in loaded}
    binders: dict[str, Binder] = {}
    for family in families:
        kernels = by_name[family.level]
        for kernel in family.kernels:
            tile_rows = 1 if kernel == TILES else 0
            binders[kernel] = lambda w, kernels=kernels, t=tile_rows: CLinear(kernels, w, None, t)
    binders[ONEDNN] = lambda w: PackedLinear(w, None)
    return binders


def _cache_key(
    cpu: CpuInfo,
    loaded: Sequence[Kernels],
    counts: Mapping[Shape, int],
    buckets: Mapping[Shape, Sequence[int]],
    prefill_candidates: Sequence[str],
) -> str:
    """What a cached choice must have been measured with: this CPU, these builds (their ids; the
    tiles granted or not), these shapes at these row counts, these threads, this torch (its oneDNN)."""
    facts = {
        "cpu": cpu.model_name,
        "isa": cpu.isa_summary,
        "builds": {k.level.name: [build_id(k.level), k.tiles] for k in loaded},
        "shapes": sorted([*s, counts[s], *buckets[s]] for s in counts),
        "prefill_candidates": list(prefill_candidates),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "version": CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def _read_entry(directory: Path | None, key: str) -> dict | None:
    """The cache's entry under `key`, or None (no cache, none yet, or unreadable)."""
    if directory is None:
        return None
    try:
        entry = json.loads((directory / CACHE_FILE).read_text())["entries"][key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if isinstance(entry, dict) else None


def _read_cache(directory: Path | None, key: str, options: KernelOptions) -> LinearPlan | None:
    entry = _read_entry(directory, key)
    if entry is None:
        return None
    try:
        return LinearPlan(
            level=entry["level"],
            exact=tuple(((n, k), kernel) for n, k, kernel in entry["exact"]),
            prefill=tuple(((n, k), kernel) for n, k, kernel in entry["prefill"]),
            prefill_rows=options.prefill_rows,
            source="cached",
            timings=tuple(Timing(kernel, (n, k), rows, s) for kernel, n, k, rows, s in entry["timings"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: measured again and rewritten


def _write_cache(directory: Path | None, key: str, plan: LinearPlan) -> None:
    _write_entry(
        directory,
        key,
        {
            "level": plan.level,
            "exact": [[*s, k] for s, k in plan.exact],
            "prefill": [[*s, k] for s, k in plan.prefill],
            "timings": _timings_json(plan.timings),
        },
    )


def _timings_json(timings: Iterable[Timing]) -> list[list]:
    return [[t.kernel, *t.shape, t.rows, t.seconds] for t in timings]


def _write_entry(directory: Path | None, key: str, entry: dict) -> None:
    """The cache file with `entry` under `key`, beside the others (a file that is not ours is
    replaced)."""
    if directory is None:
        return
    path = directory / CACHE_FILE
    try:
        entries = json.loads(path.read_text()).get("entries", {}) if path.exists() else {}
    except (OSError, ValueError, AttributeError):
        entries = {}
    if not isinstance(entries, dict):
        entries = {}
    entries[key] = entry
    temporary = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
        os.replace(temporary, path)  # whole or not at all, whatever else starts beside us
    except OSError as error:
        log.info("CPU kernels: the measured choice is not cached (%s): the next start measures again", error)
