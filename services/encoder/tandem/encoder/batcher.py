"""Concurrent Embed calls gathered into batches, with a bound on how long a call waits for company.

A call joins the queue; the first call of a batch waits at most `max_wait_s(its job)` for others
(less when `max_batch_size` calls are already there; a job worth no wait runs at once), then the batch
runs on the worker thread while new calls queue for the next one. Under load that alone batches:
everything that arrived during a batch goes into the next. A caller that gives up (its RPC cancelled,
its deadline passed) before its batch starts is left out of it; one that gives up while its batch
runs is marked gone, and `run` asks `is_gone(i)` between jobs to skip the work nobody waits for.
No caller is ever left waiting: whatever fails while a batch is delivered fails that batch's calls,
a serving task that died is started again by the next call, and `close(error)` ends queued and
running calls alike with `error()` (and every later call), marking them gone so that the batch on
the worker stops at its next check.

Calls are served cheapest first, not in arrival order, where `cost(job)` says what a job will take
(an image's declared pixels and those its preparation makes, in expected seconds): a call's place in line
is its arrival plus LINE_FACTOR times its cost, and a batch takes calls, in that order, only while their
costs add up to `max_batch_cost` (always at least one). So a caller's pile of expensive pictures no
longer holds a neighbour's cheap one behind all of them: 16 tiny WebPs each declaring 5,792 x 5,792
(2 KB of chat) held an ordinary picture sent a second later for 17.3 s when they went in arrival
order, 8 to a batch; now it waits for the one being decoded. An expensive call is never starved: a
call arriving over LINE_FACTOR times its cost after it goes after it.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")

# `run(jobs, is_gone)`: one outcome per job, in order. `is_gone(i)` says, from the worker thread, whether
# the caller of jobs[i] has stopped waiting; that job's outcome is then never delivered.
Run = Callable[[Sequence[J], Callable[[int], bool]], Sequence[R | BaseException]]

# How far back in line a call's cost puts it, per second of that cost: a picture expected to take 1 s
# to decode lets the calls arriving in the next 10 s go first, cheaper ones among them first.
LINE_FACTOR = 10.0


class CallerGone(Exception):
    """The outcome a run gives a job it skipped because its caller was gone; never delivered."""


@dataclass
class _Waiting(Generic[J, R]):
    job: J
    future: asyncio.Future[R]
    arrived: float  # time.monotonic()
    # `cost(job)` and the place in line it gives, weighed once as the call arrives: weighing the whole
    # queue again for every batch held the loop 0.23 s a batch with 10,000 image calls queued.
    cost: float = 0.0
    place: float = 0.0
    # Set once the future is done, whoever finished it: the caller going away, close(), or the batch's
    # own outcome. An Event because the worker thread reads it while the loop sets it.
    gone: threading.Event = field(default_factory=threading.Event)


class Batcher(Generic[J, R]):
    def __init__(
        self,
        executor: Executor,
        run: Run[J, R],
        max_batch_size: int,
        max_wait_s: Callable[[J], float],  # how long a batch led by this job may wait for company
        cost: Callable[[J], float] = lambda job: 0.0,  # a job's expected work, seconds: its place in line
        max_batch_cost: float = math.inf,  # what a batch's jobs may cost together (one always runs)
    ) -> None:
        self._executor = executor
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.cost = cost
        self.max_batch_cost = max_batch_cost
        self._queue: list[_Waiting[J, R]] = []
        self._running: list[_Waiting[J, R]] = []  # the batch on the worker thread now
        self._arrival = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed_with: Callable[[], BaseException] | None = None  # set by close(): later calls' error
        self.batch_sizes: list[int] = []  # every batch's size, for the benchmark and the tests

    async def submit(self, job: J) -> R:
        """The job's outcome (its exception raised) once its batch has run."""
        if self._closed_with is not None:
            raise self._closed_with()
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        arrived = time.monotonic()
        cost = self.cost(job)
        waiting = _Waiting(job, future, arrived, cost, arrived + LINE_FACTOR * cost)
        future.add_done_callback(lambda _: waiting.gone.set())
        self._queue.append(waiting)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._serve())
        self._arrival.set()
        return await future

    def close(self, error: Callable[[], BaseException]) -> int:
        """Ends every queued and running call with `error()` (one each: a raised exception collects its
        caller's frames), and refuses later ones alike; the batch on the worker skips what is left of it.
        Returns how many calls it ended."""
        self._closed_with = error
        if self._task is not None:
            self._task.cancel()
        num_ended = 0
        for waiting in [*self._queue, *self._running]:
            waiting.gone.set()  # now, not when the loop gets to the done callback
            if not waiting.future.done():
                waiting.future.set_exception(error())
                num_ended += 1
        self._queue.clear()
        return num_ended

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrival.clear()
                await self._arrival.wait()
            await self._gather()
            batch = self._take_batch()
            if not batch:
                continue
            self.batch_sizes.append(len(batch))
            self._running = batch
            jobs = [w.job for w in batch]

            def is_gone(i: int, batch: list[_Waiting[J, R]] = batch) -> bool:
                return batch[i].gone.is_set()

            try:
                outcomes = await loop.run_in_executor(self._executor, self._run, jobs, is_gone)
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} calls gave {len(outcomes)} outcomes")
            except Exception as error:  # the worker itself failed: every caller of the batch hears it
                outcomes = [error] * len(batch)
            finally:
                self._running = []
            for waiting, outcome in zip(batch, outcomes, strict=True):
                _deliver(waiting.future, outcome)

    def _take_batch(self) -> list[_Waiting[J, R]]:
        """The next batch out of the queue (callers gone are dropped): in order of place in line, while
        it has room and its costs fit max_batch_cost."""
        self._queue = [w for w in self._queue if not w.future.done()]
        # The first max_batch_size in line, as a stable sort would give them, without sorting the rest.
        line = heapq.nsmallest(self.max_batch_size, self._queue, key=lambda w: w.place)
        batch: list[_Waiting[J, R]] = []
        total = 0.0
        for waiting in line:
            if batch and total + waiting.cost > self.max_batch_cost:
                break
            batch.append(waiting)
            total += waiting.cost
        taken = {id(w) for w in batch}
        self._queue = [w for w in self._queue if id(w) not in taken]
        return batch

    async def _gather(self) -> None:
        """Until the batch is full or its first call has waited max_wait_s."""
        first = self._queue[0]
        deadline = first.arrived + self.max_wait_s(first.job)
        while len(self._queue) < self.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), left)
            except TimeoutError:
                return


def _deliver(future: asyncio.Future[R], outcome: R | BaseException) -> None:
    if future.done():  # its caller gave up meanwhile
        return
    if isinstance(outcome, BaseException):
        if isinstance(outcome, StopIteration):  # a future refuses it: keep the caller's error readable
            outcome = RuntimeError(f"StopIteration: {outcome}")
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
