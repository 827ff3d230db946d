"""What the engine tells a request's consumer, and the per-request logic that decides it.

Events, in order: one `Accepted`, zero or more `Delta`, then exactly one `Finished` or `Failed`.
`OutputState` turns each sampled token into those events: stop checks (stop tokens and EOS after
`min_new_tokens`, stop strings through the detokenizer, max tokens, the context limit), text, and
coalescing to at most one `Delta` per `stream_interval` steps, because every message costs the
gRPC layer tens of microseconds of CPU. A step yields one token, or several when it verified
proposed tokens (speculation): they count as one step and travel in one Delta.

It also keeps the request's timeline (queued, each prefill chunk, first token, preemptions,
pauses for a reader far behind, finished) as plain (name, monotonic time, attributes) records that
`Finished` carries out. The engine thread only appends to a list; turning the timeline into trace
span events is the servicer's job, once, when the request ends, so telemetry never runs on the
engine thread.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import tokenizers

from tandem.client.errors import TandemError
from tandem.decoder.engine.outputs.backpressure import MAX_STREAM_INTERVAL
from tandem.decoder.engine.outputs.detokenizer import IncrementalDetokenizer
from tandem.decoder.engine.outputs.prompt_logprobs import (
    PromptLogprob,
    PromptLogprobsBuffer,
    PromptLogprobsChunk,
)
from tandem.decoder.engine.params import StoppingParams


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # a checkpoint EOS id was produced
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched
    STOP_TOKEN = "stop_token"  # a stop_token_ids entry was produced
    CONTEXT_LIMIT = "context_limit"  # the sequence filled max_model_len
    ABORTED = "aborted"  # the server gave up on it (shutdown past its grace period)


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One moment in a request's life, recorded on the engine thread."""

    name: str  # "queued", "prefill_chunk", "first_token", "preempted", "paused", "resumed", "finished"
    time: float  # time.monotonic()
    attributes: Mapping[str, int | str] = field(default_factory=dict)  # e.g. a prefill chunk's range


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt_tokens: int  # positions in the prompt (tokens and embedding rows)


@dataclass(frozen=True)
class TopLogprobs:
    token_ids: tuple[int, ...]  # most likely first
    logprobs: tuple[float, ...]  # natural log, same order


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One token a step produced, with its logprobs when the request asked for them."""

    token_id: int
    logprob: float | None = None
    top: TopLogprobs | None = None


@dataclass(frozen=True)
class Delta:
    request_id: str
    token_ids: tuple[int, ...]  # new tokens since the previous delta
    text: str  # text that became final ("" when text is off or held back)
    logprobs: tuple[float, ...]  # one per token when asked for, else ()
    top_logprobs: tuple[TopLogprobs, ...]  # one per token when asked for, else ()
    # One per prompt position, on a request's first delta only, when prompt logprobs were asked for.
    prompt_logprobs: tuple[PromptLogprob, ...] = ()

    def followed_by(self, later: Delta) -> Delta:
        """This delta and the next one of the same request, as one."""
        return Delta(
            self.request_id,
            self.token_ids + later.token_ids,
            self.text + later.text,
            self.logprobs + later.logprobs,
            self.top_logprobs + later.top_logprobs,
            self.prompt_logprobs + later.prompt_logprobs,  # at most one of them has any
        )


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: FinishReason
    stop_sequence: str | None  # the matched stop string (STOP_SEQUENCE)
    stop_token_id: int | None  # the produced stop token (STOP_TOKEN)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt positions served from the prefix cache
    time_to_first_token_s: float
    total_time_s: float
    queue_time_s: float
    timeline: tuple[TimelineEvent, ...] = ()  # in time order, ending with "finished"
    proposed_tokens: int = 0  # speculation: proposed tokens verified over the request's life
    accepted_tokens: int = 0  # of those, the ones accepted (each an engine step saved)


@dataclass(frozen=True)
class Failed:
    request_id: str
    error: TandemError  # e.g. Unavailable after an engine fault, DeadlineExceeded while queued


Event = Accepted | Delta | Finished | Failed


@dataclass(frozen=True)
class OutputOptions:
    """Per-request output settings (the proto's OutputOptions)."""

    include_text: bool = True  # detokenize; stop strings are still checked when off
    stream_interval: int = 1  # steps per Delta, at most MAX_STREAM_INTERVAL; Finished flushes the rest


class OutputState:
    """One running request's output side, owned by the engine thread."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        is_token_ids: list[bool],  # [num_prompt_tokens] False at embedding positions
        stopping: StoppingParams,
        options: OutputOptions,
        tokenizer: tokenizers.Tokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        arrival_time: float,
        prompt_logprobs: PromptLogprobsBuffer | None = None,  # the request scores its prompt
    ) -> None:
        self.request_id = request_id
        self.stopping = stopping
        self.options = options
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_model_len = max_model_len
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        # Appended to by the engine thread only; handed out (copied) with Finished.
        self.timeline: list[TimelineEvent] = [TimelineEvent("queued", arrival_time)]
        self._stop_token_ids = frozenset(stopping.stop_token_ids)
        self._eos_token_ids = frozenset() if stopping.ignore_eos else eos_token_ids
        needs_text = options.include_text or bool(stopping.stop)
        self._detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, is_token_ids, stopping.stop, stopping.include_stop_in_output
            )
            if needs_text
            else None
        )
        self._pending_ids: list[int] = []
        self._pending_text: list[str] = []
        self._pending_logprobs: list[float] = []
        self._pending_top: list[TopLogprobs] = []
        self._steps_since_emit = 0
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self._prompt_logprobs = prompt_logprobs  # None again once delivered

    def record(self, name: str, now: float, attributes: Mapping[str, int | str] | None = None) -> None:
        """Add a moment to the timeline (engine thread; costs one list append)."""
        self.timeline.append(TimelineEvent(name, now, attributes or {}))

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Keep prompt positions scored by a step until the first delta carries them all."""
        if self._prompt_logprobs is not None:
            self._prompt_logprobs.add(chunk)

    def banned_token_ids(self, ahead: int = 0) -> list[int]:
        """EOS and stop tokens are masked at sampling until min_new_tokens were generated; `ahead`:
        for the token that follows `ahead` more (proposed) tokens."""
        if self.num_output_tokens + ahead >= self.stopping.min_new_tokens:
            return []
        return sorted(self._eos_token_ids | self._stop_token_ids)

    def on_verified(self, num_proposed: int, num_accepted: int) -> None:
        """Count a verified proposal (speculation) for Finished."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted

    def on_tokens(self, tokens: list[SampledToken], now: float) -> list[Event]:
        """Account one step's tokens in order (several when it verified a proposal); returns the
        events they release (possibly none). Tokens after one that ends the request are dropped."""
        for token in tokens:
            finish = self._add(token, now)
            if finish is not None:
                return self.finish(*finish, now=now)
        self._steps_since_emit += 1
        # At most MAX_STREAM_INTERVAL steps between Deltas: one sending nothing could never pause.
        if self._steps_since_emit >= min(max(1, self.options.stream_interval), MAX_STREAM_INTERVAL):
            return [self._take_delta()]
        return []

    def _add(self, token: SampledToken, now: float) -> tuple[FinishReason, str | None, int | None] | None:
        """Account one token; why the request ends with it, if it does."""
        token_id, logprob, top = token.token_id, token.logprob, token.top
        if self.first_token_time is None:
            self.first_token_time = now
            self.record("first_token", now)
        self.num_output_tokens += 1
        self._pending_ids.append(token_id)
        if logprob is not None:
            self._pending_logprobs.append(logprob)
        if top is not None:
            self._pending_top.append(top)
        finish = self._check_stop_token(token_id)
        if self._detokenizer is not None:
            # A stop token's own text is emitted only when include_stop_in_output asks for it.
            hide = finish is not None and not self.stopping.include_stop_in_output
            # Stop strings, as EOS and stop tokens, end nothing within min_new_tokens (as vLLM's).
            within_min = self.num_output_tokens <= self.stopping.min_new_tokens
            step = self._detokenizer.add([] if hide else [token_id], match_stops=not within_min)
            self._pending_text.append(step.new_text)
            if finish is None and step.matched_stop is not None:
                finish = (FinishReason.STOP_SEQUENCE, step.matched_stop, None)
        if finish is None and self.num_output_tokens >= self.stopping.max_new_tokens:
            finish = (FinishReason.LENGTH, None, None)
        if finish is None and self.num_prompt_tokens + self.num_output_tokens >= self.max_model_len:
            finish = (FinishReason.CONTEXT_LIMIT, None, None)
        return finish

    def finish(
        self,
        reason: FinishReason,
        stop_sequence: str | None = None,
        stop_token_id: int | None = None,
        now: float | None = None,
    ) -> list[Event]:
        """The final Delta (if anything is pending) and Finished."""
        now = time.monotonic() if now is None else now
        if self._detokenizer is not None and not self._detokenizer.is_finished:
            tail = self._detokenizer.flush()
            self._pending_text.append(tail.new_text)
        events: list[Event] = []
        if self._pending_ids or any(self._pending_text):
            events.append(self._take_delta())
        first_token = self.first_token_time if self.first_token_time is not None else now
        self.record("finished", now, {"finish_reason": reason.value})
        scheduled = self.first_scheduled_time if self.first_scheduled_time is not None else now
        events.append(
            Finished(
                request_id=self.request_id,
                reason=reason,
                stop_sequence=stop_sequence,
                stop_token_id=stop_token_id,
                prompt_tokens=self.num_prompt_tokens,
                output_tokens=self.num_output_tokens,
                cached_tokens=self.num_cached_tokens,
                time_to_first_token_s=first_token - self.arrival_time,
                total_time_s=now - self.arrival_time,
                queue_time_s=scheduled - self.arrival_time,
                timeline=tuple(self.timeline),
                proposed_tokens=self.num_proposed_tokens,
                accepted_tokens=self.num_accepted_tokens,
            )
        )
        return events

    def _check_stop_token(self, token_id: int) -> tuple[FinishReason, str | None, int | None] | None:
        # The sampler masks EOS and stop tokens until min_new_tokens, except where a grammar allows
        # nothing else (sampler.grammar_first). There EOS is the grammar's end and ends the answer; a stop
        # token is text the grammar needs (regex a+ with `a` a stop token), so within the minimum it ends
        # nothing, as before the lift: ending there gave a 1-token answer of an 8-token minimum.
        within_min = self.num_output_tokens <= self.stopping.min_new_tokens
        if token_id in self._stop_token_ids and not within_min:
            return (FinishReason.STOP_TOKEN, None, token_id)
        if token_id in self._eos_token_ids:
            return (FinishReason.EOS, None, None)
        return None

    def _take_delta(self) -> Delta:
        delta = Delta(
            request_id=self.request_id,
            token_ids=tuple(self._pending_ids),
            text="".join(self._pending_text) if self.options.include_text else "",
            logprobs=tuple(self._pending_logprobs),
            top_logprobs=tuple(self._pending_top),
            prompt_logprobs=self._take_prompt_logprobs(),
        )
        self._pending_ids.clear()
        self._pending_text.clear()
        self._pending_logprobs.clear()
        self._pending_top.clear()
        self._steps_since_emit = 0
        return delta

    def _take_prompt_logprobs(self) -> tuple[PromptLogprob, ...]:
        """The whole prompt's entries on the first delta, () on every later one. The first token is
        sampled in the step that runs the prompt's last position, so the buffer is complete by then."""
        buffer, self._prompt_logprobs = self._prompt_logprobs, None
        return () if buffer is None else buffer.entries()
