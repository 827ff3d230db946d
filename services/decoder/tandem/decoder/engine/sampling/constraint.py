"""One request's grammar state: the tokens it allows next, the tokens it took, and why it failed.

A `Constraint` wraps the request's own llguidance matcher (structured.py builds it, charged as it grows:
grammar_growth.py). Each step its `allowed()` masks the request's logits, and after the step it takes
the sampled token; a speculating step asks `valid_prefix` and `masks_along` instead. It times the
grammar's work per token in the engine thread's CPU time and fails the request where the recent
average passes its limit (structured.py's NOTE says why an average, and why CPU time). Not thread-safe:
the engine thread alone uses it after it is built.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from tandem.client.errors import InvalidArgument, TandemError
from tandem.decoder.engine.sampling.grammar_growth import MeteredMatcher, growth_refusal
from tandem.decoder.engine.sampling.grammar_messages import in_our_words, llguidance_reason

NUM_MASKS_AVERAGED = 8  # masks whose CPU time per token is averaged against the limit (structured.py's NOTE)

T = TypeVar("T")


class Constraint:
    """One request's grammar state. Not thread-safe: the engine thread alone uses it after building."""

    def __init__(
        self,
        matcher: object,
        vocab_size: int,
        field: str = "structured",
        eos_token_ids: frozenset[int] = frozenset(),
        *,
        max_token_cpu_seconds: float,  # the grammar's work per token, on average (structured.py's NOTE)
        # The matcher's first mask (llguidance's packed bits), computed where it was built: the first
        # allowed() takes it, the matcher's state the same. None: the first allowed() computes it.
        first_bitmask: bytes | None = None,
    ) -> None:
        self._matcher = matcher
        self._first_bitmask = first_bitmask
        self._num_masked = 0  # tokens taken before its last mask: those sent before its step's
        self.vocab_size = vocab_size
        self.field = field  # the request's field that asked for it (structured.regex, ...)
        self.eos_token_ids = eos_token_ids  # the model's: sampled, one always ends the answer
        self.num_accepted = 0
        self._eos_inside: int | None = None  # an EOS ID the grammar took as text, not as its end
        self._refused: tuple[int, int] | None = None  # (tokens taken before it, token) the grammar refused
        self.max_token_cpu_seconds = max_token_cpu_seconds
        self._recent_seconds: deque[float] = deque(maxlen=NUM_MASKS_AVERAGED)  # CPU per mask and token
        self._too_slow: _TooSlow | None = None  # where the average first passed max_token_cpu_seconds
        self.build_bytes = 0  # its build's charge to its caller while it lives (grammar_memory.py)
        # Its matcher, where it grows charged as it goes (grammar_growth.py): a growth refused fails it.
        self.metered: MeteredMatcher | None = matcher if isinstance(matcher, MeteredMatcher) else None

    @property
    def memory_bytes(self) -> int:
        """What its matcher is charged: its build's estimate, and its lexer states' growth since."""
        return self.build_bytes + (self.metered.charged_bytes if self.metered is not None else 0)

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar accepts next."""
        # The first mask, given, opens its entry at what it costs here (nothing): the averages weigh
        # the grammar work the engine does.
        first, self._first_bitmask = self._first_bitmask, None
        self._num_masked = self.num_accepted
        compute = self._matcher.compute_bitmask if first is None else lambda: first  # type: ignore[attr-defined]
        bitmask = self._timed(compute, is_mask=True)
        words = np.frombuffer(bitmask, dtype="<u4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[: bits.shape[0]] = bits.astype(bool)
        return torch.from_numpy(mask)

    def accept(self, token_id: int) -> None:
        was_error = self.is_error
        self._consume(token_id)
        if not was_error and self._refused is None and self.is_error:
            self._refused = (self.num_accepted, token_id)
        self.num_accepted += 1
        if token_id in self.eos_token_ids and not self._matcher.is_stopped():  # type: ignore[attr-defined]
            self._eos_inside = token_id

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar accepts in order from here (a proposal is cut there).
        Raises MatcherFull where its matcher filled and defers its rebuild (grammar_growth.py)."""
        if not token_ids:
            return 0
        validate = self._matcher.validate_tokens  # type: ignore[attr-defined]
        return int(self._timed(lambda: validate(token_ids), num_tokens=len(token_ids)))

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        """The allowed tokens here and after each of `token_ids` (a proposal the grammar accepts):
        1 + len(token_ids) masks, one per row verifying it. The state is left where it was. Raises
        MatcherFull where its matcher filled on the way and defers its rebuild (grammar_growth.py)."""
        masks = [self.allowed()]
        # llguidance records no token taken once the grammar has stopped (the EOS that a proposal
        # holds after a complete answer): rolling back those too undid tokens of the answer itself,
        # and the next token it took was refused (a request that failed only when speculating).
        num_recorded = 0
        try:
            for token_id in token_ids:
                num_recorded += not self._matcher.is_stopped()  # type: ignore[attr-defined]
                self._consume(token_id)
                masks.append(self.allowed())
        finally:  # a matcher full on the way (MatcherFull) is rebuilt at the answer, the proposal not in it
            if num_recorded:
                self._matcher.rollback(num_recorded)  # type: ignore[attr-defined]
        return masks

    @property
    def mask_seconds(self) -> float:
        """CPU time per mask (and taking its token) on average over the last NUM_MASKS_AVERAGED, a
        short start counted as cheap masks: the per-token limit's average, and the one the step's
        budget weighs (step/grammar_budget.py)."""
        return sum(self._recent_seconds) / NUM_MASKS_AVERAGED

    @property
    def is_error(self) -> bool:
        return bool(self._matcher.is_error())  # type: ignore[attr-defined]

    def error(self) -> TandemError | None:
        """Why the grammar cannot go on, or None. A grammar that compiles and begins can still exceed
        the parser's limits on the way (a regex of nested counts: `a{1000}{1000}`); its matcher then
        allows only EOS, which must not pass for an answer that parses. So must a grammar that names
        the model's EOS token as text (`<[id]>`, `<|endoftext|>`): sampled there, it ended the answer
        with FINISH_REASON_EOS where the grammar goes on. And a grammar whose work per token passed
        max_token_cpu_seconds on average (structured.py's NOTE) fails rather than hold up the batch. So
        does one whose matcher's growth could not be charged (grammar_growth.py), before llguidance's
        error for it, which names only its state limit."""
        metered = self.metered
        if metered is not None and metered.refusal is not None:
            # Counted: the tokens sent, those before the step it was refused in (the step's are not).
            num_sent = min(self._num_masked, self.num_accepted)
            return growth_refusal(self.field, num_sent, metered.max_states, metered.refusal)
        if self._eos_inside is not None:
            return InvalidArgument(
                self.field,
                f"the grammar takes the model's end-of-sequence token {self._eos_inside} as text, "
                f"after {self.num_accepted - 1} tokens of the answer, where the grammar is not "
                "complete, but that token always ends the answer: a grammar must not admit it as text "
                "(by naming it, or where the tokenizer does not mark it special)",
            )
        if self.is_error:  # llguidance's own limits first: its reason says more
            # Counted: the tokens before the one it refused (those sent), not that token; where its
            # mask failed, the tokens before that mask (the step's sampled token is accepted, not sent).
            emitted, what = min(self._num_masked, self.num_accepted), "stopped matching"
            if self._refused is not None:
                emitted, token_id = self._refused
                what = f"refused the sampled token {token_id}"
            detail = llguidance_reason(self._matcher.get_error())  # type: ignore[attr-defined]
            ours = in_our_words(detail)
            return InvalidArgument(
                self.field,
                f"the grammar failed after {emitted} tokens of the answer: it {what}"
                + (f": it {ours}" if ours else f" (the grammar engine said: {detail})" if detail else ""),
            )
        if self._too_slow is None:
            return None
        slow = self._too_slow
        return InvalidArgument(
            self.field,
            f"the grammar's work took {slow.seconds * 1000:.1f} ms of CPU per token (a mask, and taking "
            f"the token) on average over its last {NUM_MASKS_AVERAGED} masks, after {slow.num_accepted} "
            f"tokens of the answer, over the limit of {self.max_token_cpu_seconds * 1000:g} ms "
            "(an ambiguous grammar's parsing grows with its answer)",
        )

    def _consume(self, token_id: int) -> None:
        self._first_bitmask = None  # the state it was the mask of is gone
        consume = self._matcher.consume_token  # type: ignore[attr-defined]
        self._timed(lambda: consume(token_id))

    def _timed(self, run: Callable[[], T], is_mask: bool = False, num_tokens: int = 1) -> T:
        """run()'s result. Its CPU time (per token) opens a mask's entry or joins the last one; where
        the recent average passes the limit is kept for error(). This thread's CPU time: llguidance
        works on the calling thread (the GIL released)."""
        start = time.thread_time()
        result = run()
        seconds = (time.thread_time() - start) / num_tokens
        if is_mask or not self._recent_seconds:
            self._recent_seconds.append(seconds)
        else:
            self._recent_seconds[-1] += seconds
        average = self.mask_seconds  # a short start counts as cheap masks
        if average > self.max_token_cpu_seconds and self._too_slow is None:
            self._too_slow = _TooSlow(average, self.num_accepted)
        return result


@dataclass(frozen=True)
class _TooSlow:
    """Where the grammar's recent work first cost more than its constraint allows."""

    seconds: float  # CPU time per token, the average over the last NUM_MASKS_AVERAGED masks
    num_accepted: int  # tokens of the answer the grammar had taken by then
