r"""A step's grammar budget: the CPU time all of one step's grammar work (the masks, and taking the
sampled tokens) may cost before the requests that cost most fail.

NOTE: each request's own limit (sampling/structured.py's NOTE, --max-grammar-cpu-ms-per-token on
average over 8 masks) bounds what one request adds to a step, not what many add: one thread computes
every mask of a step, one after another, and the step waits for the last. 16 requests of
`s: s s | "a"`, each just under its own limit at its 420th token, cost 700 ms of CPU a step with
SmolLM2's vocabulary (64 would be 2.9 s), and a plain neighbour's median inter-token gap went from
228 to 608 ms. Where a step's grammar work passes `max_seconds`, its dearest requests fail, the dearest
first, until what the others cost fits; the others go on, and so does every request without a grammar.

Only a request heavy in itself may fail: one whose masks cost over its heavy floor each, on average
over its last 8 (`Constraint.mask_seconds`, the per-token limit's average, a short start counted as
cheap masks). Its first mask, the lexer's warm-up (up to about 150 ms, bounded by the build's fuel),
costs the engine nothing: the grammar's building thread computes it and the first step takes it, so
the average leaves no mask out. Many ordinary grammars can pass the step's budget together: 64 cold
bounded regexes (`[\w .]{1,1000}`) with Qwen3's 152k vocabulary cost 140-800 ms a step at 3-4 ms a
mask each, and 41 of the 64 failed mid-stream before this floor. A request that finished in the step
costs no later step: it neither fails nor counts.

Speculation multiplies a request's grammar work in a step: each of its verifying rows is masked, so
a proposal of k tokens costs 1 + k masks, and one request under its own per-token limit cost 510 ms
in one step at k=16 (`s: s s | /[a-z ]/` on a repeating prompt; a plain neighbour's gap 594 ms)
before the budget failed it. So a constrained request's proposal is cut before it is verified
(`num_draft_tokens_within`), to what its cost a row allows within its share of the budget (the
budget over the running constrained requests). That cost is the larger of its masks' recent average
and its last step's cost a row times that cost's growth since the step before (`row_seconds_ahead`):
the average lags a cost that grows with the answer, and cut by it the same request still verified
16 proposed tokens in a step of 562 ms, 35 ms a row, where it predicted under 16. Cutting a proposal
changes no token sampled, only how many steps they take.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import TypeVar

from tandem.client import error_reasons as reasons
from tandem.client.errors import InvalidArgument, ResourceExhausted, TandemError

K = TypeVar("K", bound=Hashable)

# The mask cost, on average, past which a request is heavy enough to fail for the step's budget.
# Measured with Qwen3's 152k vocabulary: ordinary JSON schemas cost 14 ms a mask at most, bounded
# regexes 3-4 ms, and the ambiguous attack (`s: s s | "a"`, each request kept under its own 50 ms
# limit) about 43 ms. 20 ms sits between, and above what one cold mask of llguidance's lexer (up to
# about 150 ms) adds alone to an average over 8 (19 ms).
HEAVY_MASK_SECONDS = 0.020
# How far over the step's budget one row alone must cost to be told it fits no step: a step's measure
# of the same work at the cap varied by 5% (246.8-258.8 ms at 250).
NOISE_MARGIN = 1.1


def heavy_mask_seconds(max_token_cpu_seconds: float) -> float:
    """The heavy floor under a per-token limit (--max-grammar-cpu-ms-per-token, in seconds): at most
    half of it. A fixed 20 ms under a limit of 20 ms or less made the step's cap never fire: every
    request at or over the floor had already failed for its own limit."""
    return min(HEAVY_MASK_SECONDS, max_token_cpu_seconds / 2)


def over_budget(seconds: dict[K, float], max_seconds: float, heavy: Collection[K]) -> list[K]:
    """The keys of `seconds` (each request's grammar CPU time this step) to fail, dearest first, so the
    rest cost at most `max_seconds`; only those in `heavy` may fail, so fewer where they are not enough.
    None where they all fit."""
    total = sum(seconds.values())
    failed: list[K] = []
    for key, cost in sorted(seconds.items(), key=lambda item: item[1], reverse=True):
        if total <= max_seconds:
            break
        if key in heavy:
            failed.append(key)
            total -= cost
    return failed


def num_draft_tokens_within(num_draft_tokens: int, mask_seconds: float, max_seconds: float) -> int:
    """How many of a proposal's `num_draft_tokens` a request may verify so the step's masks for it,
    one a row (the request's own and one per proposed token), cost at most `max_seconds` (its share
    of the budget) at `mask_seconds` each (`Constraint.mask_seconds`). Its own row is never cut:
    0 at least, so a request dearer than its share alone is left to the budget (over_budget)."""
    if mask_seconds * (1 + num_draft_tokens) <= max_seconds:
        return num_draft_tokens
    return max(0, int(max_seconds / mask_seconds) - 1)


def row_seconds_ahead(last: float, before: float) -> float:
    """A request's grammar cost a row in its next step, from its cost a row in its last step (`last`)
    and in the step before (`before`): the last, times its growth since (never taken as shrinking).
    An ambiguous grammar's cost grows with its answer, at least quadratically (`s: s s | /[a-z ]/`:
    9 ms a row over its tokens 12-28, 35 ms over 29-44)."""
    if before <= 0.0:
        return last
    return last * max(1.0, last / before)


def over_budget_error(
    field: str,
    seconds: float,
    step_seconds: float,
    max_seconds: float,
    num_rows: int = 1,
    *,
    is_alone: bool,
    rebuild_seconds: float = 0.0,
) -> TandemError:
    """Why a request failed for the step's grammar budget, naming its field and the limit: its
    `seconds` (its rows', its own and its verifying rows, and `rebuild_seconds` of its matcher's
    rebuilds, grammar_growth.py) over `num_rows`. INVALID_ARGUMENT where it was alone in its step
    (`is_alone`: its rows the step's only grammar work) and one row of it, one token's mask, cost over
    the budget by more than NOISE_MARGIN: no step fits it, and the retry RESOURCE_EXHAUSTED invites (its
    Retry-After) would fail the same way at the same point of its answer, for ever. Its rebuilds are
    left out of that row: a matcher grows to its limit of all once, and no retry rebuilds where it did.
    Otherwise RESOURCE_EXHAUSTED: it failed among the step's work, or within the step's noise (the
    same work at the cap measured 246.8 ms in one run and 250.2-258.8 in others), and may be retried.
    Not from the masks' average (daa4746): under the per-token limit (50 ms), which an average over
    the step's 250 ms had already passed, no request was ever told it fits no step."""
    row_seconds = (seconds - rebuild_seconds) / num_rows
    if is_alone and row_seconds > NOISE_MARGIN * max_seconds:
        return InvalidArgument(
            field,
            f"the grammar's work for one token took {row_seconds * 1000:.1f} ms of CPU in one step, over "
            f"the limit of {max_seconds * 1000:g} ms per step (--max-grammar-cpu-ms-per-step) by itself: "
            "no step fits it (an ambiguous grammar's parsing grows with its answer)",
        )
    return ResourceExhausted(
        f"{field}: the grammar's work took {seconds * 1000:.1f} ms of CPU in one step, among the dearest "
        f"of a step whose grammars took {step_seconds * 1000:.1f} ms in all, over the limit of "
        f"{max_seconds * 1000:g} ms per step (--max-grammar-cpu-ms-per-step): the dearest fail so the "
        "step's other requests go on (an ambiguous grammar's parsing grows with its answer)",
        info=reasons.decoder_info(
            reasons.GRAMMAR_CPU,
            {
                reasons.GRAMMAR_MICROSECONDS: round(seconds * 1e6),
                reasons.STEP_MICROSECONDS: round(step_seconds * 1e6),
                reasons.MAX_MICROSECONDS_PER_STEP: round(max_seconds * 1e6),
            },
        ),
    )
