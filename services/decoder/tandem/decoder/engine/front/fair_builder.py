"""Request-building threads whose work goes round the callers, not first come first served.

NOTE: why. A request is built (validated, tokenized, its grammar compiled, its chat rendered) on a few
threads before the scheduler sees it, and the scheduler's fairness (scheduling/admission_order.py)
starts only there. On a first-come-first-served pool, one caller's burst of dear builds held every
other caller's request behind it all: 32 grammars refused by llguidance's fuel (~0.1 s each on
SmolLM2's vocabulary) on one connection made a neighbour's plain grammar wait ~3 s for its turn. Here
each caller has its own line, and a free thread takes the next job of the caller whose turn is the
oldest: a burst costs a neighbour at most one job per other caller in front of it, while one caller
alone is still served in arrival order.

A caller is `GenerateSpec.caller` (api/caller.py: its token, or its connection); "" (in-process
callers) is one caller like any other.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(eq=False)  # found in its line by identity
class _Job:
    future: concurrent.futures.Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():  # cancelled as a thread took it
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as error:  # the caller's to see, as ThreadPoolExecutor hands it over
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class FairBuilder:
    """`num_threads` threads serving per-caller lines in turn (the module's NOTE)."""

    def __init__(
        self, num_threads: int, thread_name_prefix: str, initializer: Callable[[], None] | None = None
    ) -> None:
        self._lines: OrderedDict[str, deque[_Job]] = OrderedDict()  # callers in turn order, oldest first
        self._ready = threading.Condition()
        self._is_shut_down = False
        self._num_threads = num_threads
        self._thread_name_prefix = thread_name_prefix
        self._initializer = initializer
        self._threads: list[threading.Thread] = []  # started ones: they start with the first jobs
        _LIVE.add(self)

    def for_caller(self, caller: str) -> concurrent.futures.Executor:
        """An executor whose `submit` queues in `caller`'s line."""
        return _CallerView(self, caller)

    def submit(
        self, caller: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        job = _Job(future, fn, args, kwargs)
        with self._ready:
            if self._is_shut_down:
                raise RuntimeError("cannot build requests after shutdown")
            self._start_threads()
            line = self._lines.get(caller)
            if line is None:  # a caller with nothing queued joins at the back of the turn order
                line = self._lines[caller] = deque()
            line.append(job)
            self._ready.notify()
        # A job cancelled while it waits leaves its line at once: kept, a caller that cancels (a
        # deadline, a client gone) spent a turn per dead job, and its queue grew past any stream bound.
        future.add_done_callback(lambda done: self._forget(caller, job) if done.cancelled() else None)
        return future

    def num_waiting(self) -> int:
        """Jobs queued and not yet taken by a thread."""
        with self._ready:
            return sum(len(line) for line in self._lines.values())

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more jobs; `cancel_futures` cancels those not started; `wait` joins the threads."""
        with self._ready:
            self._is_shut_down = True
            waiting = [job for line in self._lines.values() for job in line] if cancel_futures else []
            if cancel_futures:
                self._lines.clear()
            self._ready.notify_all()
        for job in waiting:
            job.future.cancel()
        if wait:
            for thread in self._threads:
                thread.join()

    def _start_threads(self) -> None:
        """Starts the threads not yet running (under the lock). One that cannot start now is tried again
        at the next job; the job is refused only when no thread runs at all, as ThreadPoolExecutor does."""
        while len(self._threads) < self._num_threads:
            thread = threading.Thread(
                target=self._work, name=f"{self._thread_name_prefix}_{len(self._threads)}"
            )
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread": out of threads or memory, for now
                if not self._threads:
                    raise
                return
            self._threads.append(thread)

    def _forget(self, caller: str, job: _Job) -> None:
        with self._ready:
            line = self._lines.get(caller)
            if line is None:
                return
            for i, queued in enumerate(line):
                if queued is job:
                    del line[i]
                    break
            if not line:
                del self._lines[caller]

    def _next(self) -> _Job | None:
        """The oldest-turn caller's first job; that caller's turn moves to the back. None at shutdown
        with nothing left."""
        with self._ready:
            while not self._lines:
                if self._is_shut_down:
                    return None
                self._ready.wait()
            caller, line = next(iter(self._lines.items()))
            job = line.popleft()
            if line:
                self._lines.move_to_end(caller)
            else:
                del self._lines[caller]
            return job

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (job := self._next()) is not None:
            job.run()
            del job  # the request's state and result are not held until the next job


class _CallerView(concurrent.futures.Executor):
    """One caller's door into a FairBuilder (what stream_events submits through)."""

    def __init__(self, builder: FairBuilder, caller: str) -> None:
        self._builder = builder
        self._caller = caller

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        return self._builder.submit(self._caller, fn, *args, **kwargs)


# At interpreter exit, before non-daemon threads are joined (as concurrent.futures does): jobs still
# queued are cancelled, running ones finish, the threads end. Daemon threads instead were killed
# mid-job, and one inside a torch op aborted the process (SIGABRT, 3 of 3 tries).
_LIVE: weakref.WeakSet[FairBuilder] = weakref.WeakSet()


def _at_exit() -> None:
    for builder in list(_LIVE):
        builder.shutdown(wait=True, cancel_futures=True)


threading._register_atexit(_at_exit)  # type: ignore[attr-defined]  # concurrent.futures' own hook
