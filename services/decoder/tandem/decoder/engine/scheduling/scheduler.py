"""Which positions of which requests run next. Pure Python: no torch, no grpc.

The scheduler owns the waiting queue and the running set, asks the BlockManager for KV blocks, and
hands the runner one StepPlan per step. It never decides that a request stops (the engine checks EOS,
stop strings and max_new_tokens, then calls finish()); it only keeps every request moving.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence

from tandem.client import error_reasons as reasons
from tandem.client.errors import InvalidArgument
from tandem.decoder.engine.request import Request, RequestStatus
from tandem.decoder.engine.scheduling.admission_order import AdmissionOrder
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler_config import (
    QueueFullError,
    RequestTooLongError,
    SchedulerConfig,
)
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan

# Tokens a request keeps its slot after admission before a caller with nothing running may take it
# (when every running caller has one request and more callers wait than there are slots): slots then
# go round the callers, each turn long enough that recomputing the preempted request is a small part.
FAIR_TURN_TOKENS = 128


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()  # arrival order; preempted requests go back to the front
        # In admission order. Admission takes the first waiting request of the caller running the
        # fewest (`AdmissionOrder`): with one caller, strict FCFS; a preempted request goes back to the
        # front of the queue, so it is readmitted before anything of its caller that arrived after it.
        self.running: list[Request] = []
        # Requests whose readers are far behind: neither running nor waiting, holding no blocks,
        # until resume() queues them again (the engine decides both; see step/core.py).
        self.paused: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}  # every unfinished request by id
        self._num_admissions = 0  # admissions so far: each admitted request's turn number
        self._num_steps = 0  # schedule() calls so far: requests that sat out a step go first next time

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def has_schedulable(self) -> bool:
        """Some request is running or waiting (paused ones wait for their readers, not for a step)."""
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS within its caller). Raises RequestTooLongError if it could never fit
        in the KV pool, and QueueFullError when the waiting queue is at max_waiting. Request building
        has checked it against the model's context already (`prompt.build_request`)."""
        if request.request_id in self._requests:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in use")
        num_tokens = request.num_prompt_tokens + request.stopping.max_new_tokens
        # The last sampled token is never fed back, so its KV is never written.
        num_blocks = self.block_manager.num_blocks_for_tokens(num_tokens - 1)
        num_total_blocks = self.block_manager.num_total_blocks
        # Blame the prompt only when it is too long on its own; otherwise max_new_tokens asks too much.
        if num_blocks > num_total_blocks:
            too_long = self.block_manager.num_blocks_for_tokens(request.num_prompt_tokens) > num_total_blocks
            field = "prompt" if too_long else "stopping.max_new_tokens"
            raise RequestTooLongError(
                field,
                "the number of KV blocks",
                num_total_blocks,
                num_blocks,
                info=reasons.decoder_info(
                    reasons.KV_CAPACITY,
                    {reasons.NEEDED_BLOCKS: num_blocks, reasons.MAX_BLOCKS: num_total_blocks},
                ),
            )
        # Paused requests do not count: each holds no slot and no KV block, and only its client ends
        # it, so counted, a connection's unread streams would refuse every caller while the engine
        # idles. What bounds them is each connection's (and token's) stream bound and the server's
        # bound on calls (RELIABILITY.md, "Limits").
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting} requests, --max-queue)",
                info=reasons.decoder_info(
                    reasons.QUEUE_FULL, {reasons.MAX_WAITING_REQUESTS: self.config.max_waiting}
                ),
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self, not_runnable: Collection[str] = frozenset()) -> StepPlan:
        # NOTE: the one rule. Each request has num_computed_tokens (positions whose KV is cached)
        # and num_tokens (prompt + outputs). Each step, RUNNING requests, then WAITING ones (the
        # fewest-running caller's first, FCFS within a caller) advance num_computed_tokens toward
        # num_tokens, taking at most what is left of the step's token budget (max_num_batched_tokens),
        # with at most max_num_seqs requests running. A prefill that does not fit is chunked; decodes
        # (one position each) share the step with prefills. When a running request cannot get blocks,
        # the busiest caller's latest-admitted running request is preempted and recomputed later;
        # waiting requests are admitted only into free blocks and never cause a block preemption.
        # Callers share the batch: a full one gives a slot per step to a waiting caller running at
        # least two fewer requests than the busiest, or running none (`_yield_a_slot`).
        # And its steps: while a light caller (nothing waiting, at most shared_step_seqs running)
        # runs beside a heavy one (requests waiting, or more running), or a caller running nothing
        # is about to be admitted beside running ones, a step holds at most shared_step_seqs
        # requests, the light callers' all, the heavy ones' in turns (`_heavy_beside_a_neighbour`,
        # `_sitting_out`): a neighbour's tokens, its first included, come at a narrow step's pace.
        # And a long prefill beside them: while decode rows share the step, a prefill chunk takes the
        # threshold less those rows, at least half the threshold (`_prefill_cap`), or with prefill
        # buckets the largest bucket within the threshold; alone, a prefill takes the whole budget.
        # Requests `not_runnable` (their grammar's matcher is being rebuilt: step/grammar_rebuilds.py)
        # sit the step out wherever they are: running, they keep their blocks; waiting, none is admitted.
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._num_steps += 1
        # A request not runnable is no one's reason to move others: no slot is yielded for it
        # (the victim was re-admitted and recomputed every step while it waited), it makes no
        # caller heavy, and it takes none of its caller's turns in a narrowed step.
        yielded = self._yield_a_slot(not_runnable)
        heavy = self._heavy_beside_a_neighbour(not_runnable)
        step_limit = None if heavy is None else self.config.shared_step_seqs
        sitting_out = set() if step_limit is None else self._sitting_out(step_limit, heavy, not_runnable)
        sitting_out.update(not_runnable)
        cap = self._prefill_cap(sitting_out)
        budget = self._schedule_running(
            self.config.max_num_batched_tokens, scheduled, preempted, sitting_out, cap
        )
        # Admitting right after a block preemption would only hand the freed blocks to a newcomer.
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, step_limit, cap, not_runnable)
        preempted += yielded
        # Proposed tokens get what the step has left, after every request's own position: speculation
        # never delays an admission or causes a preemption.
        budget = self._add_drafts(budget, scheduled)
        return StepPlan(
            scheduled=tuple(scheduled),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=tuple(preempted),
            num_free_blocks_after=self.block_manager.num_free_blocks,
        )

    def _prefill_cap(self, sitting_out: set[str]) -> int | None:
        """Most positions of one request this step when decode rows share it (running requests with
        one position left, not sitting out): the threshold less those rows, at least half of it, or the
        largest prefill bucket within the threshold. None when the threshold is off or no decode runs:
        a prefill alone takes what the budget allows."""
        threshold = self.config.long_prefill_token_threshold
        if threshold is None:
            return None
        num_decodes = sum(
            1
            for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in sitting_out
        )
        if not num_decodes:
            return None
        buckets = self.config.prefill_buckets
        if buckets is not None:  # the decode rows run in a graph of their own
            return max([n for n in buckets if n <= threshold], default=buckets[0])
        return max(threshold - num_decodes, (threshold + 1) // 2)

    def _heavy_beside_a_neighbour(self, not_runnable: Collection[str] = frozenset()) -> set[str] | None:
        """The heavy callers (requests waiting, or more running than `shared_step_seqs`), when the step
        is to be narrowed: a light caller runs beside a heavy one (a neighbour beside a flood, queued
        or not), or a caller running nothing can be admitted beside running ones (a neighbour's first
        step, whose prefill and first token would otherwise wait for the whole batch). Else None, and
        every running request runs: one caller alone, callers all light or all heavy."""
        limit = self.config.shared_step_seqs
        if limit is None or not self.running:
            return None
        running = Counter(r.caller for r in self.running if r.request_id not in not_runnable)
        waiting = {r.caller for r in self.waiting if r.request_id not in not_runnable}
        heavy = waiting | {caller for caller, n in running.items() if n > limit}
        if not heavy:
            return None
        if not running.keys() <= heavy:
            return heavy
        newcomer = not waiting <= running.keys()
        return heavy if newcomer and len(self.running) < self.config.max_num_seqs else None

    def _sitting_out(
        self, limit: int, heavy: set[str], not_runnable: Collection[str] = frozenset()
    ) -> set[str]:
        """Running requests that skip this step (ids): the step holds every request of the light
        callers and, up to `limit` requests in all but at least one, the heavy callers' that ran least
        recently (so the heavy callers, together, still advance every step: beside many neighbours
        they get one row a step, as each neighbour does)."""
        runnable = [r for r in self.running if r.request_id not in not_runnable]
        others = [r for r in runnable if r.caller in heavy]
        room = max(1, limit - (len(runnable) - len(others)))
        others.sort(key=lambda r: r.last_step)  # stable: admission order among equals
        return {r.request_id for r in others[room:]}

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        preempted: list[str],
        sitting_out: set[str],
        cap: int | None,
    ) -> int:
        """Advance the running requests in order (but those sitting out), each by at most `cap`
        positions, preempting for blocks (`_block_victim`); the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.request_id in sitting_out:
                i += 1
                continue
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, budget, cap)
            if num_new_tokens == 0:
                i += 1
                continue
            while not self.block_manager.allocate_slots(request, num_new_tokens):
                # Every earlier request is already scheduled, so the victim comes from here on; it
                # may be `request` itself.
                victim = self.running.pop(self._block_victim(i))
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new_tokens))
                budget -= num_new_tokens
                i += 1
        return budget

    def _block_victim(self, first: int) -> int:
        """Index of the request to preempt for blocks, among running[first:]: the latest-admitted of
        the caller running the most (with one caller, the last one), so that a caller that just got
        its one slot is not the first to lose it when a busier caller has filled the KV cache."""
        running = Counter(r.caller for r in self.running)
        return max(range(first, len(self.running)), key=lambda j: (running[self.running[j].caller], j))

    def _admit_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        step_limit: int | None,
        cap: int | None,
        not_runnable: Collection[str] = frozenset(),
    ) -> int:
        """Admit waiting requests (in `AdmissionOrder`) into free blocks (cached prefix first), each
        for at most `cap` positions this step; the budget left. With a `step_limit` (a narrowed step),
        callers already running get no more than the step has room for; a caller running nothing is
        always let in."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return budget
        order = AdmissionOrder((r for r in self.waiting if r.request_id not in not_runnable), self.running)
        running_callers = {r.caller for r in self.running}
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = order.next()
            if request is None:
                break
            if step_limit is not None and len(scheduled) >= step_limit and request.caller in running_callers:
                break  # AdmissionOrder offers callers running nothing first: the rest run something
            computed_block_ids, num_cached_tokens = self.block_manager.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, num_cached_tokens, budget, cap)
            if not self.block_manager.allocate_slots(request, num_new_tokens, computed_block_ids):
                break  # nobody overtakes the request that is next in line
            self.waiting.remove(request)
            order.admitted(request)
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            request.num_tokens_at_admission = request.num_tokens
            self._num_admissions += 1
            request.admission_number = self._num_admissions
            self.running.append(request)
            running_callers.add(request.caller)
            scheduled.append(self._scheduled(request, num_new_tokens))
            budget -= num_new_tokens
        return budget

    def _yield_a_slot(self, not_runnable: Collection[str] = frozenset()) -> list[str]:
        """With the batch full, preempt one running request for a waiting caller that runs fewer (one
        per step; the ids preempted): the latest-admitted request of the busiest caller when the
        waiting caller runs at least two fewer (the gap shrinks by two with each yield, so slots never
        go back and forth); else, when the waiting caller runs none and every running caller one, the
        request that has run longest since its admission, once that is FAIR_TURN_TOKENS (slots go
        round the callers, a turn each)."""
        waiting = [r for r in self.waiting if r.request_id not in not_runnable]
        if len(self.running) < self.config.max_num_seqs or not waiting:
            return []
        running = Counter(r.caller for r in self.running)
        busiest, most = running.most_common(1)[0]
        fewest = min(running[r.caller] for r in waiting)
        if most - fewest >= 2:
            victim = next(r for r in reversed(self.running) if r.caller == busiest)
        elif fewest == 0:
            victim = max(self.running, key=lambda r: r.num_tokens - r.num_tokens_at_admission)
            if victim.num_tokens - victim.num_tokens_at_admission < FAIR_TURN_TOKENS:
                return []
        else:
            return []
        self.running.remove(victim)
        self._preempt(victim)
        return [victim.request_id]

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int | Sequence[int]],
        unsampled: Collection[str] = frozenset(),
    ) -> None:
        """Record that `plan` ran: advance each request and append its sampled token(s), if any.

        A request that verified n proposed tokens gets 1 to n + 1 tokens: the proposed ones that were
        accepted, then the one sampled after them. Only the positions holding accepted tokens count as
        computed; the rejected positions' KV slots lie past the sequence's end, where attention never
        reads, and the next step writes over them. Requests finished or aborted since schedule() are
        skipped; their blocks are already free. Requests `unsampled` ran but keep no sample (their
        grammar's matcher filled: step/grammar_rebuilds.py): they stay where they were, their blocks
        held, and run the same positions again, in the same chunks.
        """
        for item in plan.scheduled:
            request = item.request
            request.draft_token_ids.clear()
            if request.is_finished or item.request_id in unsampled:
                continue
            if request.num_computed_tokens != item.start:
                raise RuntimeError(
                    f"{item.request_id}: plan started at {item.start}, request is at "
                    f"{request.num_computed_tokens}; was a plan applied twice?"
                )
            request.num_computed_tokens += item.num_new_tokens
            if item.needs_logits:
                if item.request_id not in sampled:
                    raise KeyError(f"no sampled token for {item.request_id!r}, which needed logits")
                tokens = sampled[item.request_id]
                tokens = [tokens] if isinstance(tokens, int) else list(tokens)
                if not 1 <= len(tokens) <= 1 + item.num_draft_tokens:
                    raise ValueError(
                        f"{item.request_id!r} verified {item.num_draft_tokens} proposed tokens, "
                        f"so it takes 1 to {1 + item.num_draft_tokens} tokens, got {len(tokens)}"
                    )
                request.num_computed_tokens -= item.num_draft_tokens - (len(tokens) - 1)
                request.output_token_ids.extend(tokens)
            self.block_manager.cache_full_blocks(request)

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """End a waiting or running request and free its blocks. False if it is unknown or already
        finished, so callers need not track whether they raced with another finish."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status.name}")
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.PAUSED:
            del self.paused[request_id]
        elif request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        return True

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def pause(self, request_id: str) -> bool:
        """Take a running or waiting request out of scheduling and free its blocks (they stay in the
        prefix cache until reused), as a preemption does. False if it is unknown or already paused."""
        request = self._requests.get(request_id)
        if request is None or request.status is RequestStatus.PAUSED:
            return False
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids.clear()
        request.status = RequestStatus.PAUSED
        self.paused[request_id] = request
        return True

    def resume(self, request_id: str) -> bool:
        """Queue a paused request again, at the front (it arrived before everything waiting); it
        recomputes its prompt and outputs as a preempted request does. False if it is not paused."""
        request = self.paused.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        return True

    def _num_new_tokens(
        self, request: Request, num_computed_tokens: int, budget: int, cap: int | None
    ) -> int:
        most = self.config.max_tokens_per_request or cap or budget
        return min(request.num_tokens - num_computed_tokens, budget, most)

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: the outputs stay, and on resume prompt + outputs are prefilled
        # together (often from the prefix cache, since its freed blocks stay evictable).
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids.clear()
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _add_drafts(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Extend the decode steps of requests with proposed tokens by those tokens, as far as the
        step's token budget, its max_num_rows and the free blocks allow; the budget left. A proposal
        that does not fit is shortened or dropped: it was only a guess."""
        num_rows = len(scheduled)
        max_rows = self.config.max_num_rows
        for i, item in enumerate(scheduled):
            request = item.request
            drafts = request.draft_token_ids
            if not drafts:
                continue
            if not (item.needs_logits and item.num_new_tokens == 1 and not item.is_prefill):
                drafts.clear()  # only a decode step verifies: a prefill chunk has no proposal to check
                continue
            room = budget if max_rows is None else min(budget, max_rows - num_rows)
            del drafts[max(0, room) :]
            if drafts and not self.block_manager.allocate_slots(request, 1 + len(drafts)):
                drafts.clear()
            if not drafts:
                continue
            budget -= len(drafts)
            num_rows += len(drafts)
            scheduled[i] = dataclasses.replace(
                item,
                num_new_tokens=1 + len(drafts),
                block_ids=tuple(request.block_ids),
                num_draft_tokens=len(drafts),
            )
        return budget

    def _scheduled(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        request.last_step = self._num_steps
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            request=request,
            start=start,
            num_new_tokens=num_new_tokens,
            block_ids=tuple(request.block_ids),
            needs_logits=start + num_new_tokens == request.num_tokens,
            is_prefill=start < request.num_prompt_tokens,
        )
