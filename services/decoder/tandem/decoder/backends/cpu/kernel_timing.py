"""Timing the candidate kernels on this CPU (`measure`), over the model's real linears
(`linear_weights`, `projections`): interleaved, best of a few short samples, a candidate that cannot
win pruned. What the times decide is `linear_plan.decide`'s and `int8_tile_choice.decide_int8_tiles`'."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tandem.decoder.backends.cpu.linear_plan import Shape, Timing

PRUNE = 2.5  # a build this much slower than the best at a row bucket is not timed at larger ones
SAMPLE_S = 5e-5  # each timed sample repeats a call until it lasts about this long
ROUNDS = 5  # samples per (candidate, shape, rows), interleaved; the best is kept
# A model whose bf16 linears hold less than this is not measured (the highest build's kernels): its
# step's linears take tens of microseconds on any kernel, and the measurement would cost more than it
# could ever save (the tests' tiny checkpoints are such models).
MIN_MEASURED_BYTES = 16 << 20

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
