"""Prompt logprobs: each prompt position scored from the model's logits at the position before it.

NOTE: the invariant. Position p > 0 of a prompt of P positions is scored by the logits of position
p - 1, so a request scoring its prompt needs logits rows at positions 0 .. P - 2 on top of the row
it samples from (P - 1). Those rows are asked for in whichever step runs each position (`pack`
adds them to a chunked prefill's step as its positions run) and reduced in that same step to what
is delivered (a logprob, a rank and the top n per position), a slice of rows at a time: on one rank only
one slice's logits and log-softmax are ever alive (with several ranks, the step's logits too).
Every position must run: a request scoring its prompt takes no prefix-cache hit
(`Request.is_scoring_prompt`). The entries wait in a `PromptLogprobsBuffer` until the prompt is
whole, and go out with the first sampled token, which is sampled in the step that runs position
P - 1; a recompute of a position already scored (a preemption mid-prompt) finds its entry filled
and changes nothing, so no position is sent twice.

A row of logits holding NaN or infinity (a model fault, step/non_finite.py) would score its position
NaN, which no answer can carry: its chunk names the first such position instead (`first_non_finite`,
from each row's max, which NaN and +inf reach), and the engine ends that request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest

# Rows reduced at once: one slice's logits and their log-softmax are [SLICE_ROWS, vocab] float32
# each (48 MiB at SmolLM2's 49,152 entries).
SLICE_ROWS = 256


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt position as the model saw it from the positions before it."""

    token_id: int | None  # the prompt's token here; None at an embedding row
    logprob: float | None  # of token_id, natural log; None at position 0 and at embedding rows
    top_token_ids: tuple[int, ...]  # the n most likely tokens here, most likely first; () at position 0
    top_logprobs: tuple[float, ...]  # their logprobs, same order
    # token_id's rank over the whole vocabulary, 1 the likeliest: one more than the tokens strictly
    # likelier, so tied tokens share a rank (vLLM's batched_count_greater_than counts x >= its logprob,
    # ties as likelier). None wherever logprob is None.
    rank: int | None = None


@dataclass(frozen=True)
class ScoredSpan:
    """The consecutive prompt positions one request scores in one step (one logits row each)."""

    request_id: str  # the engine's key (Request.request_id)
    start: int  # first position scored; its logits row is at position start - 1
    target_ids: tuple[int, ...]  # [num_rows] the prompt token at each scored position; 0 at embedding rows
    is_token_ids: tuple[bool, ...]  # [num_rows] False where the scored position is an embedding row
    num_top: int  # most likely tokens listed per position

    @property
    def num_rows(self) -> int:
        return len(self.target_ids)


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """What one step found for one request's span: positions [start, start + len(logprobs))."""

    request_id: str  # the engine's key (Request.request_id)
    start: int  # first position scored
    logprobs: tuple[float | None, ...]  # [num_rows] of each position's token; None at embedding rows
    top_token_ids: tuple[tuple[int, ...], ...]  # [num_rows][num_top]
    top_logprobs: tuple[tuple[float, ...], ...]  # [num_rows][num_top]
    # [num_rows] of each position's token over the whole vocabulary (PromptLogprob.rank); None at
    # embedding rows
    ranks: tuple[int | None, ...]
    # The first position whose logits row held NaN or +inf or was -inf throughout (its entries are
    # NaN and must not be sent); None when every row was finite.
    first_non_finite: int | None = None


def positions_to_score(item: ScheduledRequest) -> range:
    """Positions of this step's share whose logits score the next prompt position (empty when the
    request scores nothing): those before the prompt's last, whose logits are sampled anyway."""
    request = item.request
    if not request.is_scoring_prompt:
        return range(0)
    return range(item.start, min(item.end, request.num_prompt_tokens - 1))


def scored_span(item: ScheduledRequest, positions: range) -> ScoredSpan:
    """The span scored by the logits at `positions` (from positions_to_score, not empty)."""
    request = item.request
    scored = slice(positions.start + 1, positions.stop + 1)
    num_top = request.sampling.prompt_logprobs
    assert num_top is not None
    return ScoredSpan(
        request_id=item.request_id,
        start=scored.start,
        target_ids=tuple(request.prompt_token_ids[scored]),
        is_token_ids=tuple(request.is_token_ids[scored]),
        num_top=num_top,
    )


# The logits of some of a step's scored rows: rows (a slice of them, in span order) -> float32
# [rows, vocab]. Computed on demand, so the caller decides whether they already exist.
LogitsOf = Callable[[slice], torch.Tensor]


def score(
    logits_of: LogitsOf, spans: Sequence[ScoredSpan], device: torch.device
) -> list[PromptLogprobsChunk]:
    """Each span's chunk, from its rows' logits (spans in order, their rows back to back)."""
    num_rows = sum(span.num_rows for span in spans)
    num_top = max(span.num_top for span in spans)
    targets = torch.tensor([t for s in spans for t in s.target_ids], device=device)  # [num_rows]
    token_logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)  # [num_rows]
    top_logprobs = torch.empty(num_rows, num_top, dtype=torch.float32, device=device)  # [num_rows, num_top]
    top_ids = torch.empty(num_rows, num_top, dtype=torch.int64, device=device)  # [num_rows, num_top]
    ranks = torch.empty(num_rows, dtype=torch.int64, device=device)  # [num_rows]
    is_finite = torch.empty(num_rows, dtype=torch.bool, device=device)  # [num_rows]
    for lo in range(0, num_rows, SLICE_ROWS):
        rows = slice(lo, min(lo + SLICE_ROWS, num_rows))
        logits = logits_of(rows).float()  # [slice, vocab]
        is_finite[rows] = torch.isfinite(logits.amax(dim=-1))
        logprobs = torch.log_softmax(logits, dim=-1)  # [slice, vocab]
        target = logprobs.gather(1, targets[rows, None])  # [slice, 1]
        token_logprobs[rows] = target.squeeze(1)
        if num_top:
            top_logprobs[rows], top_ids[rows] = logprobs.topk(num_top, dim=-1)
        ranks[rows] = _num_likelier(logprobs, target) + 1
    # One device-to-host copy each, then plain lists.
    token_list, top_lp_list, top_id_list = token_logprobs.tolist(), top_logprobs.tolist(), top_ids.tolist()
    rank_list, finite_list = ranks.tolist(), is_finite.tolist()
    chunks, lo = [], 0
    for span in spans:
        hi, n = lo + span.num_rows, span.num_top
        bad = next((k for k, ok in enumerate(finite_list[lo:hi]) if not ok), None)
        chunks.append(
            PromptLogprobsChunk(
                request_id=span.request_id,
                start=span.start,
                logprobs=tuple(
                    lp if is_token else None
                    for lp, is_token in zip(token_list[lo:hi], span.is_token_ids, strict=True)
                ),
                top_token_ids=tuple(tuple(ids[:n]) for ids in top_id_list[lo:hi]),
                top_logprobs=tuple(tuple(lps[:n]) for lps in top_lp_list[lo:hi]),
                ranks=tuple(
                    rank if is_token else None
                    for rank, is_token in zip(rank_list[lo:hi], span.is_token_ids, strict=True)
                ),
                first_non_finite=None if bad is None else span.start + bad,
            )
        )
        lo = hi
    return chunks


def _num_likelier(logprobs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[slice] the tokens of each row strictly likelier than its target; overwrites `logprobs`.

    The comparison is written over the row's own logprobs as 1.0 or 0.0 and summed in float32, one
    pass each and no third [slice, vocab] buffer. A sum of the bool mask casts every element on its
    way instead: 51 ms for 256 rows of SmolLM2's 49,152 on this project's CPU, as much as the
    log-softmax and top 20 together, where these two take 5 and 3 ms. A float32 sum of ones is exact
    below 2**24 in any order, so a row's count is the same in any batch.
    """
    # logprobs: [slice, vocab]; target: [slice, 1], a copy (gather), so it is not overwritten
    return logprobs.gt_(target).sum(dim=-1)


class PromptLogprobsBuffer:
    """One request's entries, filled chunk by chunk (first write wins) until the prompt is whole."""

    def __init__(self, prompt_token_ids: Sequence[int], is_token_ids: Sequence[bool]) -> None:
        self._token_ids = [
            t if is_token else None for t, is_token in zip(prompt_token_ids, is_token_ids, strict=True)
        ]
        # Position 0 has no context: its entry is complete from the start.
        first = PromptLogprob(self._token_ids[0], None, (), ())
        self._entries: list[PromptLogprob | None] = [first] + [None] * (len(self._token_ids) - 1)
        self._num_missing = len(self._entries) - 1

    @property
    def is_complete(self) -> bool:
        return self._num_missing == 0

    def add(self, chunk: PromptLogprobsChunk) -> None:
        for k, logprob in enumerate(chunk.logprobs):
            position = chunk.start + k
            if self._entries[position] is not None:
                continue  # scored before a recompute: the first result stands
            self._entries[position] = PromptLogprob(
                self._token_ids[position],
                logprob,
                chunk.top_token_ids[k],
                chunk.top_logprobs[k],
                chunk.ranks[k],
            )
            self._num_missing -= 1

    def entries(self) -> tuple[PromptLogprob, ...]:
        """Every position's entry, in order; only once complete."""
        if not self.is_complete:
            raise RuntimeError(f"prompt logprobs asked for with {self._num_missing} positions unscored")
        return tuple(e for e in self._entries if e is not None)
