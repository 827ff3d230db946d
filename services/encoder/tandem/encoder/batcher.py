"""Concurrent Embed calls gathered into batches, with a bound on how long a call waits for company.

A call joins the queue; the first call of a batch waits at most `max_wait_s(its job)` for others
(less when `max_batch_size` calls are already there; a job worth no wait runs at once), then the batch
runs on the worker thread while new calls queue for the next one. Under load that alone batches:
everything that arrived during a batch goes into the next. A caller that gives up (its RPC cancelled)
before its batch starts is left out of it. No caller is ever left waiting: whatever fails while a
batch is delivered fails that batch's calls, a serving task that died is started again by the next
call, and `close` cancels queued and running calls alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")


@dataclass
class _Waiting(Generic[J, R]):
    job: J
    future: asyncio.Future[R]
    arrived: float  # time.monotonic()


class Batcher(Generic[J, R]):
    def __init__(
        self,
        executor: Executor,
        run: Callable[[Sequence[J]], Sequence[R | BaseException]],  # one outcome per job, in order
        max_batch_size: int,
        max_wait_s: Callable[[J], float],  # how long a batch led by this job may wait for company
    ) -> None:
        self._executor = executor
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._queue: list[_Waiting[J, R]] = []
        self._running: list[_Waiting[J, R]] = []  # the batch on the worker thread now
        self._arrival = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # every batch's size, for the benchmark and the tests

    async def submit(self, job: J) -> R:
        """The job's outcome (its exception raised) once its batch has run."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(job, future, time.monotonic()))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._serve())
        self._arrival.set()
        return await future

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for waiting in [*self._queue, *self._running]:
            waiting.future.cancel()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrival.clear()
                await self._arrival.wait()
            await self._gather()
            batch = [w for w in self._queue[: self.max_batch_size] if not w.future.done()]
            del self._queue[: self.max_batch_size]
            if not batch:
                continue
            self.batch_sizes.append(len(batch))
            self._running = batch
            try:
                outcomes = await loop.run_in_executor(self._executor, self._run, [w.job for w in batch])
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} calls gave {len(outcomes)} outcomes")
            except Exception as error:  # the worker itself failed: every caller of the batch hears it
                outcomes = [error] * len(batch)
            finally:
                self._running = []
            for waiting, outcome in zip(batch, outcomes, strict=True):
                _deliver(waiting.future, outcome)

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
