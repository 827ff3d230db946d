"""One engine step, synchronously: schedule -> run -> sample -> update -> events.

NOTE: the step is the unit of consistency. Everything that changes scheduling state (new requests,
aborts, deadline expiry, finishes, pauses for readers far behind and their resumption) happens
between steps on the engine thread, under `lock`, so an abort frees its KV blocks at the next step
boundary and a request's events always come out in order.
`EngineCore` knows nothing about threads or asyncio: `loop.py` steps it, `engine.py` feeds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.errors import DeadlineExceeded, TandemError
from services.decoder.engine.backpressure import ReaderProgress
from services.decoder.engine.kv_cache import BlockManager
from services.decoder.engine.outputs import (
    Accepted,
    Event,
    Failed,
    Finished,
    FinishReason,
    OutputState,
    TopLogprobs,
)
from services.decoder.engine.prompt_logprobs import PromptLogprobsChunk
from services.decoder.engine.request import Request, RequestStatus
from services.decoder.engine.runner import ModelRunner
from services.decoder.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from services.decoder.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

Sink = Callable[[Event], None]  # receives one request's events, on the engine thread


@dataclass
class _Tracked:
    """Engine-side state of one live request, keyed by the engine's key (`request.request_id`)."""

    request: Request
    output: OutputState
    sink: Sink
    generator: torch.Generator | None  # seeded requests only
    deadline: float | None  # time.monotonic() after which a still-queued request fails
    progress: ReaderProgress | None  # how far its reader is behind; None: never paused


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.lock = threading.Lock()  # guards scheduler and _live against submit/abort threads
        self._live: dict[str, _Tracked] = {}
        self._pending_aborts: list[str] = []
        self._finish_all_reason: FinishReason | None = None  # set by finish_all, applied at the next step
        self._batch_key: tuple[str, ...] = ()
        self._batch: SamplingBatch | None = None
        self.num_steps = 0
        self.num_preemptions = 0  # requests preempted by recompute, over the engine's life

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def add(
        self,
        request: Request,
        output: OutputState,
        sink: Sink,
        deadline: float | None,
        progress: ReaderProgress | None = None,
    ) -> None:
        """Admit a request (any thread). Raises QueueFullError / RequestTooLongError synchronously.

        With `progress`, the request pauses while its reader is far behind (backpressure.py)."""
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(request.sampling.seed)
        with self.lock:
            self.scheduler.add_request(request)
            self._live[request.request_id] = _Tracked(request, output, sink, generator, deadline, progress)
            # Under the lock: the engine thread cannot schedule the request before Accepted is out,
            # so no Delta can overtake it.
            sink(Accepted(output.request_id, request.num_prompt_tokens))

    def abort(self, key: str) -> None:
        """Ask for an abort (any thread); it takes effect at the next step boundary, silently.

        `key` is the engine's own key for the request (`Request.request_id`), which no other request
        ever gets, so a late abort can never hit a newer request that reused the caller's ID.
        """
        with self.lock:
            self._pending_aborts.append(key)

    def finish_all(self, reason: FinishReason) -> int:
        """Ask (any thread) that every live request end at the next step boundary, with `reason` and
        the tokens it has (a drain that ran out of time). Returns how many requests that is."""
        with self.lock:
            self._finish_all_reason = reason
            return len(self._live)

    def has_work(self) -> bool:
        """Something to step: a request to schedule, an abort to apply or a paused one to resume. A
        request paused for its reader is no work: an engine whose requests all wait for readers idles."""
        with self.lock:
            return (
                self.scheduler.has_schedulable
                or bool(self._pending_aborts)
                or self._finish_all_reason is not None
                or any(self._is_resumable(key) for key in self.scheduler.paused)
            )

    def num_live(self) -> int:
        with self.lock:
            return len(self._live)

    def step(self) -> None:
        """Run one step and deliver its events to the requests' sinks."""
        with self.lock:
            self._apply_aborts()
            ended = self._take_all_if_asked()
            self._resume_caught_up()
            expired = self._expire_deadlines()
            plan = self.scheduler.schedule()
        for tracked, reason in ended:
            for event in tracked.output.finish(reason):
                tracked.sink(event)
        for tracked in expired:
            request_id = tracked.output.request_id
            tracked.sink(Failed(request_id, DeadlineExceeded(f"request {request_id} expired while queued")))
        for request_id in plan.preempted_ids:
            self._live[request_id].output.record("preempted", time.monotonic())
        if plan.is_empty:
            return
        self.num_preemptions += len(plan.preempted_ids)
        now = time.monotonic()
        for item in plan.scheduled:
            tracked = self._live[item.request_id]
            if tracked.output.first_scheduled_time is None:
                tracked.output.first_scheduled_time = now
                tracked.output.num_cached_tokens = item.request.num_cached_tokens
            if item.is_prefill:  # the request's timeline, for tracing; decode steps record nothing
                tracked.output.record(
                    "prefill_chunk", now, {"positions.start": item.start, "positions.end": item.end}
                )
        output = self.runner.execute(plan)
        logits = output.logits  # [num_sampling, vocab]
        self._add_prompt_logprobs(output.prompt_logprobs)
        sampling = [self._live[item.request_id] for item in plan.scheduled if item.needs_logits]
        sampled = self._sample(logits, sampling) if sampling else None
        token_ids = sampled.token_ids.tolist() if sampled is not None else []
        with self.lock:
            self.scheduler.update(
                plan, {t.request.request_id: tok for t, tok in zip(sampling, token_ids, strict=True)}
            )
        self.num_steps += 1
        self._emit(sampling, token_ids, sampled, time.monotonic())

    def fail_all(self, error: TandemError) -> None:
        """End every live request with `error` (an engine fault or shutdown) and free its blocks."""
        with self.lock:
            live = list(self._live.values())
            self._live.clear()
            for tracked in live:
                self.scheduler.abort(tracked.request.request_id)
        for tracked in live:
            tracked.sink(Failed(tracked.output.request_id, error))

    def _add_prompt_logprobs(self, chunks: tuple[PromptLogprobsChunk, ...]) -> None:
        """Hand each request the prompt positions this step scored; they go out with its first token."""
        for chunk in chunks:
            self._live[chunk.request_id].output.add_prompt_logprobs(chunk)

    def _sample(self, logits: torch.Tensor, rows: list[_Tracked]) -> SamplerOutput:
        key = tuple(t.request.request_id for t in rows)
        if key != self._batch_key or self._batch is None:
            self._batch = SamplingBatch.build(
                [t.request.sampling for t in rows],
                [t.generator for t in rows],
                [t.request.prompt_token_ids for t in rows],
                [t.request.is_token_ids for t in rows],
                self.vocab_size,
                self.runner.device,
            )
            self._batch_key = key
        banned = [t.output.banned_token_ids() for t in rows]
        return self.sampler(
            logits,
            self._batch,
            [t.request.output_token_ids for t in rows] if self._batch.has_penalties else [[] for _ in rows],
            banned if any(banned) else None,
        )

    def _emit(
        self, rows: list[_Tracked], token_ids: list[int], sampled: SamplerOutput | None, now: float
    ) -> None:
        logprobs = sampled.logprobs.tolist() if sampled is not None and sampled.logprobs is not None else None
        top_ids = top_lp = None
        if sampled is not None and sampled.top_token_ids is not None and sampled.top_logprobs is not None:
            top_ids, top_lp = sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist()
        for i, (tracked, token_id) in enumerate(zip(rows, token_ids, strict=True)):
            params = tracked.request.sampling
            logprob = logprobs[i] if logprobs is not None and params.logprobs else None
            top = None
            if top_ids is not None and top_lp is not None and params.top_logprobs:
                n = params.top_logprobs
                top = TopLogprobs(tuple(top_ids[i][:n]), tuple(top_lp[i][:n]))
            events = tracked.output.on_token(token_id, logprob, top, now)
            is_finished = bool(events) and isinstance(events[-1], Finished)
            if is_finished:
                self._retire(tracked, events[-1].reason)
            for event in events:
                tracked.sink(event)
            if not is_finished and tracked.progress is not None and tracked.progress.is_far_behind:
                self._pause(tracked, now)

    def _retire(self, tracked: _Tracked, reason: FinishReason) -> None:
        status = (
            RequestStatus.FINISHED_LENGTH if reason in _LENGTH_REASONS else RequestStatus.FINISHED_STOPPED
        )
        with self.lock:
            self.scheduler.finish(tracked.request.request_id, status)
            self._live.pop(tracked.request.request_id, None)

    def _pause(self, tracked: _Tracked, now: float) -> None:
        """Its reader is far behind: out of the batch, blocks freed, until the reader catches up."""
        assert tracked.progress is not None
        with self.lock:
            if self.scheduler.pause(tracked.request.request_id):
                tracked.progress.is_paused = True
                tracked.output.record("paused", now)

    def _is_resumable(self, key: str) -> bool:
        progress = self._live[key].progress
        return progress is not None and progress.has_caught_up

    def _resume_caught_up(self) -> None:
        """Queue again every paused request whose reader has caught up (under the lock)."""
        now = time.monotonic()
        for key in [key for key in self.scheduler.paused if self._is_resumable(key)]:
            tracked = self._live[key]
            assert tracked.progress is not None
            tracked.progress.is_paused = False
            self.scheduler.resume(key)
            tracked.output.record("resumed", now)

    def _apply_aborts(self) -> None:
        for key in self._pending_aborts:
            self.scheduler.abort(key)
            self._live.pop(key, None)
        self._pending_aborts.clear()

    def _take_all_if_asked(self) -> list[tuple[_Tracked, FinishReason]]:
        """Under `lock`: after finish_all, every live request leaves the scheduler, blocks freed."""
        reason, self._finish_all_reason = self._finish_all_reason, None
        if reason is None:
            return []
        ended = [(tracked, reason) for tracked in self._live.values()]
        for tracked, _ in ended:
            self.scheduler.abort(tracked.request.request_id)
        self._live.clear()
        return ended

    def _expire_deadlines(self) -> list[_Tracked]:
        """Drop requests whose deadline passed before their first step: they never reach prefill."""
        now = time.monotonic()
        expired = [
            t
            for t in self._live.values()
            if t.deadline is not None and now > t.deadline and t.output.first_scheduled_time is None
        ]
        for tracked in expired:
            request_id = tracked.request.request_id
            self.scheduler.abort(request_id)
            del self._live[request_id]
        return expired


_LENGTH_REASONS = (FinishReason.LENGTH, FinishReason.CONTEXT_LIMIT)
