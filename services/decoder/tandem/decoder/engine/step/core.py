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
(`position_seed`). The request keeps the samples while they equal the proposal, and the first one
that differs (or the one after the whole proposal). For a proposal that is one fixed sequence this
is the standard rejection rule: sample t ~ p and accept proposal d when t == d happens with
probability p(d), and the t of a rejection is distributed as p without d, renormalized. So the
output has exactly the distribution it has without speculation, greedy keeps the longest prefix
that equals the arg-max, and a seeded request gives the same tokens with speculation as without.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.client.errors import DeadlineExceeded, FailedPrecondition, NotFound, TandemError, Unavailable
from tandem.common.model_name import echo
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
from tandem.decoder.engine.sampling.grammar_growth import MatcherFull
from tandem.decoder.engine.sampling.prompt_lookup import PromptLookup, verified_tokens
from tandem.decoder.engine.sampling.sampler import Sampler, SamplerOutput, SamplingBatch
from tandem.decoder.engine.scheduling.adapters import Adapter, AdapterSlots
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler import ScheduledRequest, Scheduler, StepPlan
from tandem.decoder.engine.step import grammar_budget, non_finite
from tandem.decoder.engine.step.grammar_budget import (
    num_draft_tokens_within,
    over_budget,
    over_budget_error,
    row_seconds_ahead,
)
from tandem.decoder.engine.step.grammar_rebuilds import GrammarRebuilds
from tandem.decoder.engine.step.runner import ModelRunner

log = logging.getLogger(__name__)


class EngineFault(Exception):
    """Raised by work between steps after which the engine cannot go on (the other ranks missed an
    adapter install, so they would run its slot with other weights): its caller gets UNAVAILABLE,
    and the step loop fails every open request, as after a failed step."""


EventCallback = Callable[[Event], None]  # receives one request's events, on the engine thread
T = TypeVar("T")


@dataclass
class _Tracked:
    """Engine-side state of one live request, keyed by the engine's key (`request.request_id`)."""

    request: Request
    output: OutputState
    on_event: EventCallback
    # Seeded requests: one generator per token sampled in a step (1 + proposed tokens), reseeded for
    # the output position it samples before every step. Empty for unseeded requests.
    generators: list[torch.Generator]
    deadline: float | None  # time.monotonic() after which a still-queued request fails
    progress: ReaderProgress | None  # how far its reader is behind; None: never paused
    lookup: PromptLookup | None  # its token history, when it speculates
    # Tokens to propose next: the request's maximum after a fully accepted proposal, one more than
    # the accepted ones after a rejection, so a request whose guesses miss costs one extra position.
    num_to_propose: int = 0
    # Its grammar's CPU time a row (a mask, and taking its token) in its last two steps that masked it,
    # the last first: the trend its next proposal is cut by (grammar_budget.row_seconds_ahead).
    grammar_row_seconds: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class _Row:
    """One sampled position of a step: request `tracked`'s output position n + `ahead`."""

    tracked: _Tracked
    ahead: int  # 0 = the token after the last sampled one; j = after j proposed tokens


def _has_constraint(plan: StepPlan) -> bool:
    return any(item.needs_logits and item.request.constraint is not None for item in plan.scheduled)


@dataclass(frozen=True)
class _GrammarMasks:
    """A step's grammar masks, computed on the mask thread (`_grammar_masks`)."""

    # One entry per sampled row of the step, in the order `step` builds its rows: the grammar's allowed
    # tokens for a constrained request's row (after the proposed tokens before it), None otherwise
    # (and for the rows of `full` requests, whose samples are dropped).
    allowed: list[torch.Tensor | None]
    seconds: dict[str, float]  # each constrained request's masks' CPU time, by key (grammar_budget.py)
    # Requests whose matchers filled (MatcherFull), rebuilt a slice a step (grammar_rebuilds.py).
    full: set[str]


def _grammar_masks(plan: StepPlan) -> _GrammarMasks:
    masks = _GrammarMasks([], {}, set())
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


@dataclass
class _StepOutput:
    """One request's events for its tokens of a step, computed before they are delivered."""

    tracked: _Tracked
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
        self.adapters = adapters
        self.runner = runner
        self.vocab_size = vocab_size
        self.speculative_max_batch = speculative_max_batch
        self.sampler = Sampler(argmax=runner.executor.argmax)
        self._mask_pool: ThreadPoolExecutor | None = None  # grammar masks beside the forward pass
        self._rebuilds = GrammarRebuilds()  # full grammar matchers, rebuilt a slice a step
        self.lock = threading.Lock()  # guards scheduler and _live against submit/abort threads
        self._live: dict[str, _Tracked] = {}
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
        tracked = _Tracked(
            request, output, on_event, generators, deadline, progress, lookup, request.num_speculative_tokens
        )
        if request.constraint is not None and request.constraint.metered is not None:
            request.constraint.metered.defers_rebuilds = True  # rebuilt a slice a step (grammar_rebuilds.py)
        with self.lock:
            if request.adapter:
                self._resolve_adapter(request)
            self.scheduler.add_request(request)
            self._live[request.request_id] = tracked
            # Under the lock: the engine thread cannot schedule the request before Accepted is out,
            # so no Delta can overtake it.
            on_event(Accepted(output.request_id, request.num_prompt_tokens))

    def _resolve_adapter(self, request: Request) -> None:
        """Under `lock`: the slot and cache salt of the adapter the request names; NotFound if none."""
        if self.adapters is None:
            raise NotFound(f"adapter {echo(request.adapter)} is not loaded: this server runs without LoRA")
        adapter = self.adapters.get(request.adapter)
        request.adapter_slot = adapter.slot
        request.cache_salt = adapter.cache_salt

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
            if self.adapters is None:
                raise NotFound(f"adapter {echo(name)} is not loaded: this server runs without LoRA")
            slot = self.adapters.remove(name, self._adapter_slots_in_use()).slot
            return sum(1 for t in self._live.values() if t.request.adapter_slot == slot)

    def loaded_adapters(self) -> list[Adapter]:
        with self.lock:
            return [] if self.adapters is None else self.adapters.adapters

    def check_can_load(self, name: str) -> None:
        """Raises unless an adapter could be loaded as `name` now: a new name, and a free slot or one
        `take_slot` could reclaim. Ends nothing: the load may still fail on its files, or its caller
        leave before the install."""
        with self.lock:
            if self.adapters is None:
                raise FailedPrecondition("name", "this server runs without LoRA: start it with --enable-lora")
            self.adapters.check_new(name)
            self._release_drained()
            if not self.adapters.has_free_slot and self._reclaimable_slot() is None:
                self.adapters.free_slot()  # raises: every slot taken

    def take_slot(self) -> int:
        """Under `lock`, on the engine thread, by the install of an adapter read and checked: a free
        slot; where none is, the lowest draining slot that only requests paused for their readers use,
        whose requests end (FAILED_PRECONDITION naming the unload) and leave the engine (they hold no
        KV blocks). A paused request's reader may never read again, and unloading promised the slot
        back: it would otherwise be held for ever (issue: a stream nobody reads). Only here, where the
        load is sure to take the slot, so a load that fails on its files, or whose caller left, ends
        no one; a slow reader keeps its stream while no load needs its slot, and a running request is
        never ended. ResourceExhausted when no slot is free nor reclaimable."""
        assert self.adapters is not None
        self._release_drained()
        slot = None if self.adapters.has_free_slot else self._reclaimable_slot()
        if slot is not None:
            ended = [t for t in self._live.values() if t.request.adapter_slot == slot]
            for tracked in ended:
                self.scheduler.abort(tracked.request.request_id)
                del self._live[tracked.request.request_id]
                # Under the lock, as add's Accepted: the callbacks only post the event.
                tracked.on_event(Failed(tracked.output.request_id, _unloaded_while_paused(tracked.request)))
            self._release_drained()
        return self.adapters.free_slot()

    def _reclaimable_slot(self) -> int | None:
        """Under `lock`: the lowest draining slot that no request but ones paused for their readers
        uses; None if there is none."""
        assert self.adapters is not None
        users: dict[int, list[str]] = {slot: [] for slot in self.adapters.draining}
        for tracked in self._live.values():
            if tracked.request.adapter_slot in users:
                users[tracked.request.adapter_slot].append(tracked.request.request_id)
        paused = self.scheduler.paused
        return min((s for s, keys in users.items() if all(key in paused for key in keys)), default=None)

    def _release_drained(self) -> None:
        """Under `lock`: free the unloaded adapters' slots whose last request has ended."""
        if self.adapters is not None and self.adapters.num_draining:
            self.adapters.release(self._adapter_slots_in_use())

    def _adapter_slots_in_use(self) -> set[int]:
        return {t.request.adapter_slot for t in self._live.values() if t.request.adapter_slot >= 0}

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
            self._release_drained()  # before a load takes a slot
            self._run_queued()
            self._resume_caught_up()
            expired = self._expire_deadlines()
            self._rebuilds.drop(self._live)  # their requests left: nothing of their rebuilds goes on
        self._rebuilds.advance()  # off the lock: only the engine thread touches constraints
        with self.lock:
            self._propose()
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
        masks = self._masks().submit(_grammar_masks, plan) if _has_constraint(plan) else None
        output = self.runner.execute(plan)
        logits = output.logits  # [num_sampled_positions, vocab]
        # Requests the model failed this step (step/non_finite.py), by engine key: they end after it.
        faults = self._add_prompt_logprobs(output.prompt_logprobs)
        items = [item for item in plan.scheduled if item.needs_logits]
        rows = [
            _Row(self._live[item.request_id], j) for item in items for j in range(1 + item.num_draft_tokens)
        ]
        grammar = masks.result() if masks is not None else _GrammarMasks([], {}, set())
        grammar_seconds = grammar.seconds
        # A request whose matcher filled sits out until it is rebuilt: its samples here are dropped.
        for request_id in grammar.full - faults.keys():
            self._rebuilds.start(request_id, self._live[request_id].request.constraint)  # type: ignore[arg-type]
        sampled = self._sample(logits, rows, grammar.allowed or None) if rows else None
        samples = []
        if sampled is not None:
            samples = non_finite.mark_non_finite(sampled.token_ids.tolist(), sampled.is_finite.tolist())
        kept = self._verify(items, samples, skip=grammar.full)
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
        over = self._over_grammar_budget(items, grammar_seconds, rebuild_seconds, done)
        self._deliver(outputs, failing={item.request_id for item, _ in over})
        broken.extend(over)
        for request_id, fault in faults.items():
            tracked = self._live.get(request_id)
            if tracked is not None:  # the tokens before its fault did not finish it
                log.warning("request %r failed: %s", tracked.output.request_id, fault.message)
                self._fail(request_id, fault)
        for item, error in broken:
            self._fail(item.request_id, error)

    def _over_grammar_budget(
        self,
        items: list[ScheduledRequest],
        grammar_seconds: dict[str, float],
        rebuild_seconds: dict[str, float],
        done: set[str],
    ) -> list[tuple[ScheduledRequest, TandemError]]:
        """The requests whose grammar work this step fails for the step's budget (grammar_budget.py),
        with their errors: only heavy ones, and none of `done` (finished, or failing for their own
        reasons), which neither fail nor count. `rebuild_seconds`: of each one's grammar seconds,
        its matcher's rebuilds'."""
        by_key = {item.request_id: item for item in items}
        heavy = {
            key
            for key in grammar_seconds
            if key not in done and by_key[key].request.constraint.mask_seconds > self.heavy_mask_seconds  # type: ignore[union-attr]
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
                    self.max_grammar_seconds_per_step,
                    num_rows=1 + by_key[key].num_draft_tokens,
                    is_alone=len(grammar_seconds) == 1,  # its rows the step's only grammar work
                    rebuild_seconds=rebuild_seconds.get(key, 0.0),
                ),
            )
            for key in over_budget(seconds, self.max_grammar_seconds_per_step, heavy)
        ]

    def _masks(self) -> ThreadPoolExecutor:
        if self._mask_pool is None:  # made by the first constrained step
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar")
        return self._mask_pool

    def close(self) -> None:
        """Stops the grammar-mask thread (the engine's shutdown)."""
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False, cancel_futures=True)

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

    def _propose(self) -> None:
        """Under `lock`: each decoding request that speculates proposes its next tokens, while the
        batch is small enough for verified rows to cost little (`speculative_max_batch`)."""
        running = self.scheduler.running
        if self.speculative_max_batch is not None and len(running) > self.speculative_max_batch:
            return
        # Each constrained request's share of the step's grammar budget bounds its rows' masks.
        num_constrained = sum(request.constraint is not None for request in running)
        share_seconds = self.max_grammar_seconds_per_step / max(1, num_constrained)
        rebuilding = self._rebuilds.pending()
        for request in running:
            tracked = self._live[request.request_id]
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
                    self._rebuilds.start(request.request_id, request.constraint)
            request.draft_token_ids = draft

    def _sample(
        self, logits: torch.Tensor, rows: list[_Row], allowed: list[torch.Tensor | None] | None = None
    ) -> SamplerOutput:
        key = tuple((row.tracked.request.request_id, row.ahead) for row in rows)
        for row in rows:  # a seeded row's noise is its output position's, whatever the step
            request = row.tracked.request
            if request.sampling.seed is not None:
                generators = row.tracked.generators
                while len(generators) <= row.ahead:
                    generators.append(torch.Generator(device=self.runner.device))
                position = request.num_output_tokens + row.ahead
                generators[row.ahead].manual_seed(position_seed(request.sampling.seed, position))
        if key != self._batch_key or self._batch is None:
            self._batch = SamplingBatch.build(
                [row.tracked.request.sampling for row in rows],
                [_generator(row) for row in rows],
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
            [_history(row) for row in rows] if self._batch.has_penalties else [[] for _ in rows],
            banned if any(banned) else None,
            allowed,
        )

    def _verify(
        self,
        items: list[ScheduledRequest],
        token_ids: list[int],
        skip: set[str] | frozenset[str] = frozenset(),
    ) -> list[list[int]]:
        """Each sampling request's tokens of this step: its samples up to and including the first one
        that differs from its proposal (all of them when none does). token_ids: one per row. Those of
        `skip` (samples dropped) leave no trace in the proposals' counts."""
        kept: list[list[int]] = []
        row = 0
        for item in items:
            proposal = item.request.draft_token_ids[: item.num_draft_tokens]
            tokens = verified_tokens(proposal, token_ids[row : row + 1 + item.num_draft_tokens])
            row += 1 + item.num_draft_tokens
            kept.append(tokens)
            if proposal and item.request_id not in skip:
                num_accepted = len(tokens) - 1
                tracked = self._live[item.request_id]
                tracked.num_to_propose = (
                    item.request.num_speculative_tokens if num_accepted == len(proposal) else num_accepted + 1
                )
                tracked.output.on_verified(len(proposal), num_accepted)
                self.num_proposed_tokens += len(proposal)
                self.num_accepted_tokens += num_accepted
        return kept

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


def _unloaded_while_paused(request: Request) -> FailedPrecondition:
    """Why a request paused for its reader ended when a load took its unloaded adapter's slot: not
    retryable as it is (the adapter is gone), so no RESOURCE_EXHAUSTED."""
    return FailedPrecondition(
        "adapter",
        f"adapter {echo(request.adapter)} was unloaded while this request was paused for its reader "
        f"(its stream unread), and a LoadAdapter took its slot: the request ended after "
        f"{request.num_output_tokens} tokens",
    )


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output position: a hash of both, so the noise of
    every position is its own whatever a step samples, and nearby seeds or positions share nothing.
    (CPU generators keep the low 32 bits, CUDA's all 64.)"""
    key = (seed % 2**64).to_bytes(8, "little") + position.to_bytes(8, "little")
    digest = hashlib.blake2b(key, digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _generator(row: _Row) -> torch.Generator | None:
    generators = row.tracked.generators
    return generators[row.ahead] if generators else None


def _history(row: _Row) -> list[int]:
    """The output tokens row `row`'s penalties count: the request's, then the proposal's first j."""
    request = row.tracked.request
    return request.output_token_ids + request.draft_token_ids[: row.ahead]
