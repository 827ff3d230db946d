"""Request-building threads whose work goes round the callers, not first come first served.

NOTE: why. A request is built (validated, tokenized, its grammar compiled, its chat rendered) on a few
threads before the scheduler sees it, and the scheduler's fairness (scheduling/admission_order.py)
starts only there. On a first-come-first-served pool, one caller's burst of dear builds held every
other caller's request behind it all: 16 regexes refused by llguidance's fuel (~0.22 s each on
SmolLM2's vocabulary, a 2-core Zen 4 under load) on one connection held a neighbour's grammar request
3.6-3.9 s, 0.44-0.49 s taking turns. Here
each caller has its own line, and a free thread takes the next job of the caller whose turn is the
oldest: a burst costs a neighbour at most one job per other caller in front of it, while one caller
alone is still served in arrival order.

A caller is `GenerateSpec.caller` (api/caller.py: its token, or its connection); "" (in-process
callers) is one caller like any other.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
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


class _Lines:
    """The callers' lines and the threads' wake-ups: what the threads hold, never the builder itself,
    so that a builder dropped without shutdown() is collected and its threads end (as
    ThreadPoolExecutor's do)."""

    def __init__(self) -> None:
        self.lines: OrderedDict[str, deque[_Job]] = OrderedDict()  # callers in turn order, oldest first
        self.ready = threading.Condition()
        self.is_closed = False

    def put(self, caller: str, job: _Job) -> None:
        """Under `ready`: a caller with nothing queued joins at the back of the turn order."""
        line = self.lines.get(caller)
        if line is None:
            line = self.lines[caller] = deque()
        line.append(job)
        self.ready.notify()

    def forget(self, caller: str, done: concurrent.futures.Future[Any]) -> None:
        """`done`'s job leaves `caller`'s line if it was cancelled there. A cancelled job kept in line
        cost its caller a turn per dead job (deadlines, clients gone), and the line grew past any
        stream bound."""
        if not done.cancelled():
            return
        with self.ready:
            line = self.lines.get(caller)
            if line is None:
                return
            for i, queued in enumerate(line):
                if queued.future is done:
                    del line[i]
                    break
            if not line:
                del self.lines[caller]

    def take(self) -> _Job | None:
        """The oldest-turn caller's first job, waiting for one; that caller's turn moves to the back.
        None once closed with nothing left."""
        with self.ready:
            while not self.lines:
                if self.is_closed:
                    return None
                self.ready.wait()
            caller, line = next(iter(self.lines.items()))
            job = line.popleft()
            if line:
                self.lines.move_to_end(caller)
            else:
                del self.lines[caller]
            return job

    def close(self, cancel_waiting: bool = True) -> None:
        """No more jobs; the threads end once the lines are empty. `cancel_waiting` empties them."""
        with self.ready:
            self.is_closed = True
            waiting = [job for line in self.lines.values() for job in line] if cancel_waiting else []
            if cancel_waiting:
                self.lines.clear()
            self.ready.notify_all()
        for job in waiting:  # outside the lock: each cancel runs its done callbacks (forget)
            job.future.cancel()


class FairBuilder:
    """`num_threads` threads serving per-caller lines in turn (the module's NOTE)."""

    def __init__(
        self, num_threads: int, thread_name_prefix: str, initializer: Callable[[], None] | None = None
    ) -> None:
        self._lines = _Lines()
        self._num_threads = num_threads
        self._thread_name_prefix = thread_name_prefix
        self._initializer = initializer
        self._threads: list[threading.Thread] = []  # started ones: they start with the first jobs
        # Dropped without shutdown(): the jobs queued still run (as ThreadPoolExecutor's), then the
        # threads end.
        weakref.finalize(self, self._lines.close, False)
        _OPEN.add(self._lines)

    def for_caller(self, caller: str) -> concurrent.futures.Executor:
        """An executor whose `submit` queues in `caller`'s line."""
        return _CallerView(self, caller)

    def submit(
        self, caller: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lines.ready:
            if self._lines.is_closed:
                raise RuntimeError("cannot build requests after shutdown")
            self._start_threads()
            self._lines.put(caller, _Job(future, fn, args, kwargs))
        # The callback holds no job: job -> future -> callback -> job was a cycle that kept every
        # finished job's arguments and result (a request's rows) until the cycle collector ran.
        future.add_done_callback(functools.partial(self._lines.forget, caller))
        return future

    def num_waiting(self) -> int:
        """Jobs queued and not yet taken by a thread."""
        with self._lines.ready:
            return sum(len(line) for line in self._lines.lines.values())

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more jobs; `cancel_futures` cancels those not started; `wait` joins the threads."""
        self._lines.close(cancel_futures)
        if wait:
            for thread in self._threads:
                thread.join()

    def _start_threads(self) -> None:
        """Starts the threads not yet running (under the lock). One that cannot start now is tried again
        at the next job; the job is refused only when no thread runs at all, as ThreadPoolExecutor does."""
        while len(self._threads) < self._num_threads:
            thread = threading.Thread(
                target=_work,
                args=(self._lines, self._initializer),
                name=f"{self._thread_name_prefix}_{len(self._threads)}",
            )
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread": out of threads or memory, for now
                if not self._threads:
                    raise
                return
            self._threads.append(thread)


def _work(lines: _Lines, initializer: Callable[[], None] | None) -> None:
    if initializer is not None:
        initializer()
    while (job := lines.take()) is not None:
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
# mid-job, and one inside a torch op aborted the process (SIGABRT, 3 of 3 tries). Weak: the lines of
# a builder whose threads have ended are gone from here.
_OPEN: weakref.WeakSet[_Lines] = weakref.WeakSet()


def _at_exit() -> None:
    for lines in list(_OPEN):
        lines.close()


threading._register_atexit(_at_exit)  # type: ignore[attr-defined]  # concurrent.futures' own hook
