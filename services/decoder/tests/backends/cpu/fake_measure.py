"""`kernel_choice.measure` replaced by made-up timings, for the tests of a choice at load
(test_kernel_choice.py, test_kernel_cache.py)."""

from __future__ import annotations

import pytest

from tandem.decoder.backends.cpu import kernel_choice
from tandem.decoder.backends.cpu.linear_plan import Timing


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
