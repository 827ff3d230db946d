"""Timing the candidates (backends/cpu/kernel_timing.py): interleaved, each sample long enough to
time, and a candidate slower on every shape no longer timed."""

from __future__ import annotations

import pytest
import torch

from tandem.decoder.backends.cpu.kernel_timing import measure


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
