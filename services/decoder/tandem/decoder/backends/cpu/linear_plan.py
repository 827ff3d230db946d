"""The plan of the bf16 linears' kernels (`LinearPlan`) and its decision from measured times (`decide`,
pure: the tests give it made-up times). The rule it follows is `kernel_choice.py`'s note: one exact
kernel per shape for every call below `prefill_rows`, one build for the model, and a kernel replaces
the default only when faster by `MARGIN` (a prefill-only one by `PREFILL_MARGIN`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tandem.decoder.backends.cpu.kernel_options import TILES, KernelOptions

ONEDNN = "onednn"  # oneDNN's packed bf16 linear: a prefill-only candidate
MARGIN = 1.05  # a kernel replaces the default only when this much faster (geometric mean)
# A prefill-only kernel must pay for more: a step mixing decode rows with a chunk is then split, and
# the decode rows' sub-step reads every weight a second time.
PREFILL_MARGIN = 1.25

Shape = tuple[int, int]  # a linear's weight: (out_features, in_features)
_T = TypeVar("_T")


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
        for (shape, rows), timings in grouped(self.timings).items():
            chosen = self.exact_of(shape) if rows < self.prefill_rows else self.prefill_of(shape)
            cells = ", ".join(
                f"{t.kernel}{'*' if t.kernel == chosen else ''} {t.seconds * 1e3:.3f}"
                for t in sorted(timings, key=lambda t: t.seconds)
            )
            lines.append(f"  {shape_name(shape):>11} x {rows:>4} rows: {cells} ms")
        return "\n".join(lines)


def _tally(kernels: Iterable[tuple[Shape, str]]) -> str:
    by_kernel: dict[str, list[str]] = {}
    for shape, kernel in kernels:
        by_kernel.setdefault(kernel, []).append(shape_name(shape))
    return ", ".join(f"{kernel} ({' '.join(shapes)})" for kernel, shapes in sorted(by_kernel.items()))


def shape_name(shape: Shape) -> str:
    """A shape as the logged tables write it: "960x576"."""
    return f"{shape[0]}x{shape[1]}"


def grouped(timings: Iterable[Timing]) -> dict[tuple[Shape, int], list[Timing]]:
    """The timings by (shape, rows), in the order measured: a logged table's lines."""
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
