"""Speculation's two halves around a step: before it, each decoding request that speculates proposes
its next tokens (`propose`); after it, each keeps its samples while they equal its proposal, and the
first that differs (`verify`).

Why that keeps the output's distribution, and how every verifying row is sampled as a plain step
would sample it, is core.py's NOTE: this module only decides what is proposed and what is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.decoder.engine.request import Request
from tandem.decoder.engine.sampling.grammar_growth import MatcherFull
from tandem.decoder.engine.sampling.prompt_lookup import verified_tokens
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest
from tandem.decoder.engine.step.grammar_budget import num_draft_tokens_within, row_seconds_ahead
from tandem.decoder.engine.step.grammar_rebuilds import GrammarRebuilds
from tandem.decoder.engine.step.tracked import Tracked


def propose(
    running: Sequence[Request],
    live: dict[str, Tracked],
    rebuilds: GrammarRebuilds,
    *,
    speculative_max_batch: int | None,
    max_grammar_seconds_per_step: float,
) -> None:
    """Under the engine's lock: each decoding request that speculates proposes its next tokens
    (`request.draft_token_ids`), while the batch is small enough for verified rows to cost little
    (`speculative_max_batch`; None: any)."""
    if speculative_max_batch is not None and len(running) > speculative_max_batch:
        return
    # Each constrained request's share of the step's grammar budget bounds its rows' masks.
    num_constrained = sum(request.constraint is not None for request in running)
    share_seconds = max_grammar_seconds_per_step / max(1, num_constrained)
    rebuilding = rebuilds.pending()
    for request in running:
        tracked = live[request.request_id]
        if tracked.lookup is None or request.num_computed_tokens != request.num_tokens - 1:
            continue  # no speculation, or a prefill (chunk) to run first
        if request.request_id in rebuilding:
            continue  # its matcher is being rebuilt: it proposes when it runs again
        lookup = tracked.lookup
        lookup.extend(request.output_token_ids[len(lookup.history) - request.num_prompt_tokens :])
        # The proposal and the token after it must fit max_new_tokens and the context.
        room = min(
            request.stopping.max_new_tokens - request.num_output_tokens,
            tracked.output.max_model_len - request.num_tokens,
        )
        draft = lookup.propose(min(tracked.num_to_propose, room - 1))
        if request.constraint is not None:
            # Each verifying row costs a mask (grammar_budget.py): cut to what the share pays for,
            # before validating, then to what the grammar accepts (all that is worth verifying).
            row_seconds = max(
                request.constraint.mask_seconds, row_seconds_ahead(*tracked.grammar_row_seconds)
            )
            draft = draft[: num_draft_tokens_within(len(draft), row_seconds, share_seconds)]
            try:
                draft = draft[: request.constraint.valid_prefix(draft)]
            except MatcherFull:  # it sits out until rebuilt, then proposes the same again
                draft = []
                rebuilds.start(request.request_id, request.constraint)
        request.draft_token_ids = draft


@dataclass(frozen=True)
class Verified:
    """What `verify` kept of a step's samples, and its counts for the engine's totals."""

    kept: list[list[int]]  # one per sampling request, in the step's order: the tokens it keeps
    num_proposed: int  # proposed tokens verified (those of requests whose samples were dropped: none)
    num_accepted: int  # of those, the ones accepted


def verify(
    items: list[ScheduledRequest],
    token_ids: list[int],
    live: dict[str, Tracked],
    skip: set[str] | frozenset[str] = frozenset(),
) -> Verified:
    """Each sampling request's tokens of this step: its samples up to and including the first one
    that differs from its proposal (all of them when none does). token_ids: one per row. Those of
    `skip` (samples dropped) leave no trace in the proposals' counts; the others' next proposal
    is sized by how much of this one was accepted."""
    kept: list[list[int]] = []
    num_proposed = num_accepted_all = 0
    row = 0
    for item in items:
        proposal = item.request.draft_token_ids[: item.num_draft_tokens]
        tokens = verified_tokens(proposal, token_ids[row : row + 1 + item.num_draft_tokens])
        row += 1 + item.num_draft_tokens
        kept.append(tokens)
        if proposal and item.request_id not in skip:
            num_accepted = len(tokens) - 1
            tracked = live[item.request_id]
            tracked.num_to_propose = (
                item.request.num_speculative_tokens if num_accepted == len(proposal) else num_accepted + 1
            )
            tracked.output.on_verified(len(proposal), num_accepted)
            num_proposed += len(proposal)
            num_accepted_all += num_accepted
    return Verified(kept, num_proposed, num_accepted_all)
