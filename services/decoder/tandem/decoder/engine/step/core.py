"""One engine step, synchronously: schedule -> run -> sample -> update -> events.

NOTE: the step is the unit of consistency. Everything that changes scheduling state (new requests,
aborts, deadline expiry, finishes, pauses for readers far behind and their resumption) happens
between steps on the engine thread, under `lock`, so an abort frees its KV blocks at the next step
boundary and a request's events always come out in order.
`EngineCore` knows nothing about threads or asyncio: `front/loop.py` steps it, `front/engine.py` feeds it.

NOTE: speculation. Before scheduling, each decoding request with `num_speculative_tokens` proposes
its next tokens from its own history (`sampling/prompt_lookup.py`); the scheduler runs them after the
request's last token in the same step, as far as the step has room. Every one of those positions
is sampled exactly as a plain decode step would sample it, given the tokens before it, the
proposal included: row j's penalties count the proposal's first j tokens, its min-tokens mask is
the one j tokens later, and a seeded request's noise is drawn for its output position n + j
(`sampled_rows.position_seed`). The request keeps the samples while they equal the proposal, and
the first one that differs (or the one after the whole proposal). For a proposal that is one fixed
sequence this is the standard rejection rule: sample t ~ p and accept proposal d when t == d
happens with probability p(d), and the t of a rejection is distributed as p without d,
renormalized. So the output has exactly the distribution it has without speculation, greedy keeps
the longest prefix that equals the arg-max, and a seeded request gives the same tokens with
speculation as without. What is proposed and kept is speculation.py's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.client.errors import DeadlineExceeded, TandemError, Unavailable
from tandem.decoder.engine.outputs.backpressure import ReaderProgress
from tandem.decoder.engine.outputs.outputs import (
    Accepted,
    Event,
    Failed,
    Finished,
    FinishReason,
    OutputState,
    SampledToken,
    TopLogprobs,
)
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprobsChunk
from tandem.decoder.engine.request import Request, RequestStatus
from tandem.decoder.engine.sampling.prompt_lookup import PromptLookup
from tandem.decoder.engine.sampling.sampler import Sampler, SamplerOutput, SamplingBatch
from tandem.decoder.engine.scheduling.adapters import Adapter, AdapterSlots
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler import Scheduler
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest
from tandem.decoder.engine.step import grammar_budget, non_finite, sampled_rows, speculation, step_grammar
from tandem.decoder.engine.step.adapter_slots import LiveAdapterSlots
from tandem.decoder.engine.step.grammar_rebuilds import GrammarRebuilds
from tandem.decoder.engine.step.runner import ModelRunner
from tandem.decoder.engine.step.sampled_rows import Row
from tandem.decoder.engine.step.step_grammar import GrammarMasks, MaskThread
from tandem.decoder.engine.step.tracked import EventCallback, Tracked

log = logging.getLogger(__name__)


class EngineFault(Exception):
    """Raised by work between steps after which the engine cannot go on (the other ranks missed an
    adapter install, so they would run its slot with other weights): its caller gets UNAVAILABLE,
    and the step loop fails every open request, as after a failed step."""


T = TypeVar("T")


@dataclass
class _StepOutput:
    """One request's events for its tokens of a step, computed before they are delivered."""

    tracked: Tracked
    events: list[Event]  # its OutputState's events, in order
    is_finished: bool  # the last of them is Finished
    now: float  # the step's time


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        vocab_size: int,
        speculative_max_batch: int | None = None,  # more running requests: no proposals; None = any
        adapters: AdapterSlots | None = None,  # the LoRA slots' names; None: LoRA off
        max_grammar_seconds_per_step: float = math.inf,  # all of a step's grammar work (grammar_budget.py)
        # A request's grammar work per mask, on average, over which it may fail for that budget.
        heavy_mask_seconds: float = grammar_budget.HEAVY_MASK_SECONDS,
    ) -> None:
        self.scheduler = scheduler
        self.max_grammar_seconds_per_step = max_grammar_seconds_per_step
        self.heavy_mask_seconds = heavy_mask_seconds
        self.runner = runner
        self.vocab_size = vocab_size
        self.speculative_max_batch = speculative_max_batch
        self.sampler = Sampler(argmax=runner.executor.argmax)
        self._mask_thread = MaskThread()  # grammar masks beside the forward pass
        self._rebuilds = GrammarRebuilds()  # full grammar matchers, rebuilt a slice a step
        self.lock = threading.Lock()  # guards scheduler and _live against submit/abort threads
        self._live: dict[str, Tracked] = {}
        self._adapter_slots = LiveAdapterSlots(adapters, scheduler, self._live)  # under `lock`
        self._pending_aborts: list[str] = []
        self._finish_all_reason: FinishReason | None = None  # set by finish_all, applied at the next step
        # Work for the engine thread between two steps (loading an adapter's weights into its slot).
        self._between_steps: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._failed: TandemError | None = None  # fail_all's error: nothing queued would ever run
        self._batch_key: tuple[str, ...] = ()
        self._batch: SamplingBatch | None = None
        self.num_steps = 0
        self.num_preemptions = 0  # requests preempted by recompute, over the engine's life
        self.num_proposed_tokens = 0  # proposed tokens verified, over the engine's life
        self.num_accepted_tokens = 0  # of those, the ones accepted

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def adapters(self) -> AdapterSlots | None:
        """The LoRA slots' names; None: LoRA off."""
        return self._adapter_slots.slots

    def add(
        self,
        request: Request,
        output: OutputState,
        on_event: EventCallback,
        deadline: float | None,
        progress: ReaderProgress | None = None,
    ) -> None:
        """Admit a request (any thread). Raises QueueFullError / RequestTooLongError synchronously.

        With `progress`, the request pauses while its reader is far behind (outputs/backpressure.py)."""
        generators = []
        if request.sampling.seed is not None:
            generators = [torch.Generator(device=self.runner.device)]
        lookup = None
        if request.num_speculative_tokens:
            lookup = PromptLookup(request.prompt_token_ids, request.is_token_ids)
        tracked = Tracked(
            request, output, on_event, generators, deadline, progress, lookup, request.num_speculative_tokens
        )
        if request.constraint is not None and request.constraint.metered is not None:
            request.constraint.metered.defers_rebuilds = True  # rebuilt a slice a step (grammar_rebuilds.py)
        with self.lock:
            if request.adapter:
                self._adapter_slots.resolve(request)
            self.scheduler.add_request(request)
            self._live[request.request_id] = tracked
            # Under the lock: the engine thread cannot schedule the request before Accepted is out,
            # so no Delta can overtake it.
            on_event(Accepted(output.request_id, request.num_prompt_tokens))

    def between_steps(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread before the next step, holding `lock` (any thread may ask).
        The caller may cancel the future until `fn` starts (its caller gave up): `fn` then never runs.
        After `fail_all` the future fails at once, with its error."""
        future: Future[T] = Future()
        with self.lock:
            if self._failed is not None:
                future.set_exception(self._failed)
            else:
                self._between_steps.append((fn, future))
        return future

    def run_between_steps(self) -> None:
        """Run what `between_steps` queued (the engine thread: each step, and before the loop starts)."""
        with self.lock:
            self._run_queued()

    def _run_queued(self) -> None:
        work, self._between_steps = self._between_steps, []
        for i, (fn, future) in enumerate(work):
            # A cancelled future (a LoadAdapter whose caller left) would refuse its result with
            # InvalidStateError, raised on the engine thread: its work is skipped instead.
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except EngineFault as fault:  # the step loop's to handle: fail_all answers the rest
                future.set_exception(Unavailable(f"the decoder engine failed: {fault}"))
                self._between_steps[:0] = work[i + 1 :]
                raise
            except Exception as error:  # the caller's to report; the engine goes on
                future.set_exception(error)

    def unload_adapter(self, name: str) -> int:
        """Withdraw adapter `name` (NotFound if not loaded): new requests can no longer name it, and its
        slot is freed once its live requests have ended. Returns how many live requests still use it."""
        with self.lock:
            return self._adapter_slots.unload(name)

    def loaded_adapters(self) -> list[Adapter]:
        with self.lock:
            return self._adapter_slots.loaded()

    def check_can_load(self, name: str) -> None:
        """Raises unless an adapter could be loaded as `name` now (adapter_slots.py); ends nothing."""
        with self.lock:
            self._adapter_slots.check_can_load(name)

    def take_slot(self) -> int:
        """Under `lock`, on the engine thread, by the install of an adapter read and checked: a free
        slot, or one that only requests paused for their readers use, which end (adapter_slots.py)."""
        return self._adapter_slots.take_slot()

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
                self._has_runnable()
                or bool(self._rebuilds.pending())
                or bool(self._pending_aborts)
                or bool(self._between_steps)
                or self._finish_all_reason is not None
                or any(self._is_resumable(key) for key in self.scheduler.paused)
            )

    def _has_runnable(self) -> bool:
        """Under `lock`: a running or waiting request not sitting out for its matcher's rebuild (where
        all rebuild, the engine steps only to give the rebuilds their slices)."""
        if not self.scheduler.has_schedulable:
            return False
        pending = self._rebuilds.pending()
        return not pending or any(
            r.request_id not in pending for r in (*self.scheduler.running, *self.scheduler.waiting)
        )

    def num_live(self) -> int:
        with self.lock:
            return len(self._live)

    def step(self) -> None:
        """Run one step and deliver its events to the requests' callbacks."""
        with self.lock:
            self._apply_aborts()
            ended = self._take_all_if_asked()
            self._adapter_slots.release_drained()  # before a load takes a slot
            self._run_queued()
            self._resume_caught_up()
            expired = self._expire_deadlines()
            self._rebuilds.drop(self._live)  # their requests left: nothing of their rebuilds goes on
        self._rebuilds.advance()  # off the lock: only the engine thread touches constraints
        with self.lock:
            speculation.propose(
                self.scheduler.running,
                self._live,
                self._rebuilds,
                speculative_max_batch=self.speculative_max_batch,
                max_grammar_seconds_per_step=self.max_grammar_seconds_per_step,
            )
            plan = self.scheduler.schedule(not_runnable=self._rebuilds.pending())
        for tracked, reason in ended:
            for event in tracked.output.finish(reason):
                tracked.on_event(event)
        for tracked in expired:
            request_id = tracked.output.request_id
            tracked.on_event(
                Failed(request_id, DeadlineExceeded(f"request {request_id} expired while queued"))
            )
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
        # Grammar masks on a helper thread while the model runs the step (sampling/structured.py).
        masks = self._mask_thread.submit(plan)
        output = self.runner.execute(plan)
        logits = output.logits  # [num_sampled_positions, vocab]
        # Requests the model failed this step (step/non_finite.py), by engine key: they end after it.
        faults = self._add_prompt_logprobs(output.prompt_logprobs)
        items = [item for item in plan.scheduled if item.needs_logits]
        rows = [
            Row(self._live[item.request_id], j) for item in items for j in range(1 + item.num_draft_tokens)
        ]
        grammar = masks.result() if masks is not None else GrammarMasks([], {}, set())
        grammar_seconds = grammar.seconds
        # A request whose matcher filled sits out until it is rebuilt: its samples here are dropped.
        for request_id in grammar.full - faults.keys():
            self._rebuilds.start(request_id, self._live[request_id].request.constraint)  # type: ignore[arg-type]
        sampled = self._sample(logits, rows, grammar.allowed or None) if rows else None
        samples = []
        if sampled is not None:
            samples = non_finite.mark_non_finite(sampled.token_ids.tolist(), sampled.is_finite.tolist())
        verified = speculation.verify(items, samples, self._live, skip=grammar.full)
        kept = verified.kept
        self.num_proposed_tokens += verified.num_proposed
        self.num_accepted_tokens += verified.num_accepted
        for i, item in enumerate(items):  # a failed request keeps the tokens before its fault, if any
            if item.request_id in grammar.full:
                kept[i] = []
            kept[i], ahead = non_finite.cut_at_non_finite(kept[i])
            if item.request_id in faults:  # its prompt's scoring failed: an earlier position
                kept[i] = []
            elif ahead is not None:
                faults[item.request_id] = non_finite.at_output(
                    item.request.num_output_tokens + ahead, item.request.adapter
                )
        broken: list[tuple[ScheduledRequest, TandemError]] = []
        rebuild_seconds: dict[str, float] = {}
        for item, tokens in zip(items, kept, strict=True):  # the grammar takes what was sampled
            if item.request.constraint is not None and item.request_id not in grammar.full:
                start = time.thread_time()
                for token_id in tokens:
                    item.request.constraint.accept(token_id)
                grammar_seconds[item.request_id] = grammar_seconds.get(item.request_id, 0.0) + (
                    time.thread_time() - start
                )
                tracked = self._live[item.request_id]
                row_seconds = grammar_seconds[item.request_id] / (1 + item.num_draft_tokens)
                tracked.grammar_row_seconds = (row_seconds, tracked.grammar_row_seconds[0])
                # Its matcher's rebuilds count in the step's budget, not in its rows' cost
                # (grammar_growth.py's NOTE): one taken in a step, and a deferred one's build and
                # 20 ms slices (step/grammar_rebuilds.py), charged whole at its first step back,
                # though each slice held a step up 20 ms at most (and the build up to ~60 ms once):
                # a dear replay may still end its request over the budget, as when it stalled the step.
                if (metered := item.request.constraint.metered) is not None:
                    rebuild_seconds[item.request_id] = metered.take_rebuild_seconds()
                    grammar_seconds[item.request_id] += rebuild_seconds[item.request_id]
                if item.request_id not in faults and (error := item.request.constraint.error()) is not None:
                    broken.append((item, error))
        with self.lock:
            for request_id in faults:  # out before the update, which skips it: no token, no cached block
                self.scheduler.abort(request_id)
            self.scheduler.update(
                plan,
                {
                    item.request_id: t
                    for item, t in zip(items, kept, strict=True)
                    if item.request_id not in faults and item.request_id not in grammar.full
                },
                unsampled=grammar.full,
            )
        self.num_steps += 1
        skip = {item.request_id for item, _ in broken}
        skip.update(item.request_id for item, tokens in zip(items, kept, strict=True) if not tokens)
        outputs = self._outputs(items, kept, sampled, time.monotonic(), skip=skip)
        # The step's grammar budget, once the step's finished requests are known: they cost no later
        # step, so they neither fail for it nor count in it.
        done = {item.request_id for item, _ in broken} | set(faults)
        done.update(output.tracked.request.request_id for output in outputs if output.is_finished)
        over = step_grammar.over_step_budget(
            items,
            grammar_seconds,
            rebuild_seconds,
            done,
            max_seconds_per_step=self.max_grammar_seconds_per_step,
            heavy_mask_seconds=self.heavy_mask_seconds,
        )
        self._deliver(outputs, failing={item.request_id for item, _ in over})
        broken.extend(over)
        for request_id, fault in faults.items():
            tracked = self._live.get(request_id)
            if tracked is not None:  # the tokens before its fault did not finish it
                log.warning("request %r failed: %s", tracked.output.request_id, fault.message)
                self._fail(request_id, fault)
        for item, error in broken:
            self._fail(item.request_id, error)

    def close(self) -> None:
        """Stops the grammar-mask thread (the engine's shutdown)."""
        self._mask_thread.close()

    def fail_all(self, error: TandemError) -> None:
        """End every live request with `error` (an engine fault or shutdown) and free its blocks."""
        with self.lock:
            live = list(self._live.values())
            self._live.clear()
            for tracked in live:
                self.scheduler.abort(tracked.request.request_id)
            self._rebuilds.drop(())
            work, self._between_steps = self._between_steps, []
            self._failed = error
        for _, future in work:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        for tracked in live:
            tracked.on_event(Failed(tracked.output.request_id, error))

    def _add_prompt_logprobs(self, chunks: tuple[PromptLogprobsChunk, ...]) -> dict[str, TandemError]:
        """Hand each request the prompt positions this step scored; they go out with its first token.
        Returns the requests whose scored logits were not finite, by engine key, with their error."""
        faults: dict[str, TandemError] = {}
        for chunk in chunks:
            if chunk.first_non_finite is not None:
                adapter = self._live[chunk.request_id].request.adapter
                faults.setdefault(chunk.request_id, non_finite.at_prompt(chunk.first_non_finite, adapter))
            elif chunk.request_id not in faults:
                self._live[chunk.request_id].output.add_prompt_logprobs(chunk)
        return faults

    def _sample(
        self, logits: torch.Tensor, rows: list[Row], allowed: list[torch.Tensor | None] | None = None
    ) -> SamplerOutput:
        key = tuple((row.tracked.request.request_id, row.ahead) for row in rows)
        sampled_rows.reseed(rows, self.runner.device)
        if key != self._batch_key or self._batch is None:
            self._batch = SamplingBatch.build(
                [row.tracked.request.sampling for row in rows],
                [sampled_rows.generator(row) for row in rows],
                [row.tracked.request.prompt_token_ids for row in rows],
                [row.tracked.request.is_token_ids for row in rows],
                self.vocab_size,
                self.runner.device,
            )
            self._batch_key = key
        banned = [row.tracked.output.banned_token_ids(row.ahead) for row in rows]
        return self.sampler(
            logits,
            self._batch,
            [sampled_rows.history(row) for row in rows] if self._batch.has_penalties else [[] for _ in rows],
            banned if any(banned) else None,
            allowed,
        )

    def _outputs(
        self,
        items: list[ScheduledRequest],
        kept: list[list[int]],
        sampled: SamplerOutput | None,
        now: float,
        skip: set[str] | frozenset[str] = frozenset(),  # requests failed instead (_fail)
    ) -> list[_StepOutput]:
        """Each request's events for its tokens of the step, not yet delivered (_deliver)."""
        logprobs = sampled.logprobs.tolist() if sampled is not None and sampled.logprobs is not None else None
        top_ids = top_lp = None
        if sampled is not None and sampled.top_token_ids is not None and sampled.top_logprobs is not None:
            top_ids, top_lp = sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist()
        outputs: list[_StepOutput] = []
        first_row = 0
        for item, tokens in zip(items, kept, strict=True):
            if item.request_id in skip:
                first_row += 1 + item.num_draft_tokens
                continue
            tracked = self._live[item.request_id]
            params = tracked.request.sampling
            step: list[SampledToken] = []
            for i, token_id in enumerate(tokens, start=first_row):
                logprob = logprobs[i] if logprobs is not None and params.logprobs else None
                top = None
                if top_ids is not None and top_lp is not None and params.top_logprobs:
                    n = params.top_logprobs
                    top = TopLogprobs(tuple(top_ids[i][:n]), tuple(top_lp[i][:n]))
                step.append(SampledToken(token_id, logprob, top))
            first_row += 1 + item.num_draft_tokens
            events = tracked.output.on_tokens(step, now)
            outputs.append(
                _StepOutput(tracked, events, bool(events) and isinstance(events[-1], Finished), now)
            )
        return outputs

    def _deliver(self, outputs: list[_StepOutput], failing: set[str] | frozenset[str] = frozenset()) -> None:
        """Send each request's events, retiring those that finished; those `failing` send nothing
        (they end in _fail: an answer so far ends in an error, never in tokens it did not keep)."""
        for output in outputs:
            tracked = output.tracked
            if tracked.request.request_id in failing:
                continue
            if output.is_finished:
                self._retire(tracked, output.events[-1].reason)  # type: ignore[union-attr]
            for event in output.events:
                tracked.on_event(event)
            if not output.is_finished and tracked.progress is not None and tracked.progress.is_far_behind:
                self._pause(tracked, output.now)

    def _fail(self, request_id: str, error: TandemError) -> None:
        """End one live request with `error` (its grammar broke) and free its blocks; its step's
        tokens are not sent: the answer so far ends in an error, never in an EOS it did not earn."""
        with self.lock:
            tracked = self._live.pop(request_id, None)
            if tracked is None:
                return
            self.scheduler.abort(request_id)
        tracked.on_event(Failed(tracked.output.request_id, error))

    def _retire(self, tracked: Tracked, reason: FinishReason) -> None:
        status = (
            RequestStatus.FINISHED_LENGTH if reason in _LENGTH_REASONS else RequestStatus.FINISHED_STOPPED
        )
        with self.lock:
            self.scheduler.finish(tracked.request.request_id, status)
            self._live.pop(tracked.request.request_id, None)

    def _pause(self, tracked: Tracked, now: float) -> None:
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

    def _take_all_if_asked(self) -> list[tuple[Tracked, FinishReason]]:
        """Under `lock`: after finish_all, every live request leaves the scheduler, blocks freed."""
        reason, self._finish_all_reason = self._finish_all_reason, None
        if reason is None:
            return []
        ended = [(tracked, reason) for tracked in self._live.values()]
        for tracked, _ in ended:
            self.scheduler.abort(tracked.request.request_id)
        self._live.clear()
        return ended

    def _expire_deadlines(self) -> list[Tracked]:
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
