"""A step's grammar budget: the CPU time all of one step's grammar work (the masks, and taking the
sampled tokens) may cost before the requests that cost most fail.

NOTE: each request's own limit (sampling/structured.py's NOTE, --max-grammar-cpu-ms-per-token on
average over 8 masks) bounds what one request adds to a step, not what many add: one thread computes
every mask of a step, one after another, and the step waits for the last. 16 requests of
`s: s s | "a"`, each just under its own limit at its 420th token, cost 700 ms of CPU a step with
SmolLM2's vocabulary (64 would be 2.9 s), and a plain neighbour's median inter-token gap went from
228 to 608 ms. Where a step's grammar work passes `max_seconds`, its dearest requests fail, the dearest
first, until what the others cost fits; the others go on, and so does every request without a grammar.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

from tandem.client.errors import ResourceExhausted

K = TypeVar("K", bound=Hashable)


def over_budget(seconds: dict[K, float], max_seconds: float) -> list[K]:
    """The keys of `seconds` (each request's grammar CPU time this step) to fail, dearest first, so the
    rest cost at most `max_seconds`; none where they all fit."""
    total = sum(seconds.values())
    failed: list[K] = []
    for key, cost in sorted(seconds.items(), key=lambda item: item[1], reverse=True):
        if total <= max_seconds:
            break
        failed.append(key)
        total -= cost
    return failed


def over_budget_error(
    field: str, seconds: float, step_seconds: float, max_seconds: float
) -> ResourceExhausted:
    """Why a request failed for the step's grammar budget, naming its field and the limit."""
    return ResourceExhausted(
        f"{field}: the grammar's work took {seconds * 1000:.1f} ms of CPU in one step, among the dearest "
        f"of a step whose grammars took {step_seconds * 1000:.1f} ms in all, over the limit of "
        f"{max_seconds * 1000:g} ms per step (--max-grammar-cpu-ms-per-step): the dearest fail so the "
        "step's other requests go on (an ambiguous grammar's parsing grows with its answer)"
    )
