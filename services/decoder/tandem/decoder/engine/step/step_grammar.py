"""A step's grammar work beside its flow: the masks of its constrained rows, computed on a helper
thread while the model runs the step (`MaskThread`, `masks_of`), and which requests the step's
grammar seconds fail for its budget once its tokens are taken (`over_step_budget`).

The budget's rules (who is heavy, who fails first, the error) are grammar_budget.py's; what one
request's grammar costs a step, masks and matcher rebuilds apart, is measured here and in core.py.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tandem.client.errors import TandemError
from tandem.decoder.engine.sampling.grammar_growth import MatcherFull
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan
from tandem.decoder.engine.step.grammar_budget import over_budget, over_budget_error


@dataclass(frozen=True)
class GrammarMasks:
    """A step's grammar masks, computed on the mask thread (`masks_of`)."""

    # One entry per sampled row of the step, in the order `step` builds its rows: the grammar's allowed
    # tokens for a constrained request's row (after the proposed tokens before it), None otherwise
    # (and for the rows of `full` requests, whose samples are dropped).
    allowed: list[torch.Tensor | None]
    seconds: dict[str, float]  # each constrained request's masks' CPU time, by key (grammar_budget.py)
    # Requests whose matchers filled (MatcherFull), rebuilt a slice a step (grammar_rebuilds.py).
    full: set[str]


def has_constraint(plan: StepPlan) -> bool:
    return any(item.needs_logits and item.request.constraint is not None for item in plan.scheduled)


def masks_of(plan: StepPlan) -> GrammarMasks:
    masks = GrammarMasks([], {}, set())
    for item in plan.scheduled:
        if not item.needs_logits:
            continue
        constraint = item.request.constraint
        num_rows = 1 + item.num_draft_tokens
        if constraint is None:
            masks.allowed.extend([None] * num_rows)
            continue
        start = time.thread_time()  # this thread's: llguidance masks on it
        try:
            masks.allowed.extend(
                constraint.masks_along(item.request.draft_token_ids[: item.num_draft_tokens])
            )
        except MatcherFull:
            masks.allowed.extend([None] * num_rows)
            masks.full.add(item.request_id)
            continue
        masks.seconds[item.request_id] = time.thread_time() - start
    return masks


class MaskThread:
    """The one helper thread a step's masks are computed on (sampling/structured.py), made by the
    first constrained step: an engine that never serves a grammar starts no thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, plan: StepPlan) -> Future[GrammarMasks] | None:
        """The plan's masks, started now; None when no row of it is constrained."""
        if not has_constraint(plan):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar")
        return self._pool.submit(masks_of, plan)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def over_step_budget(
    items: list[ScheduledRequest],
    grammar_seconds: dict[str, float],
    rebuild_seconds: dict[str, float],
    done: set[str],
    *,
    max_seconds_per_step: float,
    heavy_mask_seconds: float,
) -> list[tuple[ScheduledRequest, TandemError]]:
    """The requests whose grammar work this step fails for the step's budget (grammar_budget.py),
    with their errors: only heavy ones (over `heavy_mask_seconds` a mask), and none of `done`
    (finished, or failing for their own reasons), which neither fail nor count. `rebuild_seconds`:
    of each one's grammar seconds, its matcher's rebuilds'."""
    by_key = {item.request_id: item for item in items}
    heavy = {
        key
        for key in grammar_seconds
        if key not in done and by_key[key].request.constraint.mask_seconds > heavy_mask_seconds  # type: ignore[union-attr]
    }
    # A light request's rebuild is metering's work and it never fails for the budget: counted in the
    # step's total it failed a heavy neighbour that fits on its own (220 ms of masks beside 1 ms + a
    # 40 ms rebuild, limit 250). A heavy one's rebuilds count, so the dearest of those fails.
    seconds = {
        key: cost if key in heavy else cost - rebuild_seconds.get(key, 0.0)
        for key, cost in grammar_seconds.items()
        if key not in done
    }
    step_seconds = sum(seconds.values())
    return [
        (
            by_key[key],
            over_budget_error(
                by_key[key].request.constraint.field,  # type: ignore[union-attr]
                seconds[key],
                step_seconds,
                max_seconds_per_step,
                num_rows=1 + by_key[key].num_draft_tokens,
                is_alone=len(grammar_seconds) == 1,  # its rows the step's only grammar work
                rebuild_seconds=rebuild_seconds.get(key, 0.0),
            ),
        )
        for key in over_budget(seconds, max_seconds_per_step, heavy)
    ]
