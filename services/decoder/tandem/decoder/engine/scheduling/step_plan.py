"""What the scheduler hands the runner for one step: which positions of which requests run. Pure Python.

One `StepPlan` per forward pass, one `ScheduledRequest` per request in it; the runner packs them into
tensors (step/batch.py) and the scheduler's update() advances each request by what the plan ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.decoder.engine.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: positions [start, start + num_new_tokens)."""

    request_id: str  # the request's id
    request: Request  # token ids, embedding spans and sampling params; mutated only by update()
    start: int  # num_computed_tokens before this step: first position to run
    num_new_tokens: int  # positions to run this step, >= 1
    block_ids: tuple[int, ...]  # the request's whole block table after this step's allocation
    needs_logits: bool  # the step reaches num_tokens: sample from the last 1 + num_draft_tokens positions
    is_prefill: bool  # start < num_prompt_tokens (some positions may be embedding rows)
    # The last positions run the request's proposed tokens (`request.draft_token_ids[:n]`), verified
    # by this step: the step samples 1 + n tokens and keeps the ones the proposal got right.
    num_draft_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class StepPlan:
    """Everything the runner needs from the scheduler for one forward pass."""

    scheduled: tuple[ScheduledRequest, ...]  # batch order: running requests first, then admitted
    num_batched_tokens: int  # sum of num_new_tokens, <= max_num_batched_tokens
    preempted_ids: tuple[str, ...]  # requests whose blocks this step took back (recompute later)
    num_free_blocks_after: int  # BlockManager.num_free_blocks once this step's blocks are held

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
