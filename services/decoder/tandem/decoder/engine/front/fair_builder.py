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
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class FairBuilder:
    """`num_threads` threads serving per-caller lines in turn (the module's NOTE)."""

    def __init__(
        self, num_threads: int, thread_name_prefix: str, initializer: Callable[[], None] | None = None
    ) -> None:
        self._lines: OrderedDict[str, deque[_Job]] = OrderedDict()  # callers in turn order, oldest first
        self._ready = threading.Condition()
        self._is_shut_down = False
        self._initializer = initializer
        self._threads = [
            threading.Thread(target=self._work, name=f"{thread_name_prefix}_{i}", daemon=True)
            for i in range(num_threads)
        ]
        self._started = False

    def for_caller(self, caller: str) -> concurrent.futures.Executor:
        """An executor whose `submit` queues in `caller`'s line."""
        return _CallerView(self, caller)

    def submit(
        self, caller: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._ready:
            if self._is_shut_down:
                raise RuntimeError("cannot build requests after shutdown")
            if not self._started:  # threads start with the first job, as ThreadPoolExecutor's do
                self._started = True
                for thread in self._threads:
                    thread.start()
            line = self._lines.get(caller)
            if line is None:  # a caller with nothing queued joins at the back of the turn order
                line = self._lines[caller] = deque()
            line.append((future, fn, args, kwargs))
            self._ready.notify()
        return future

    def num_waiting(self) -> int:
        """Jobs queued and not yet taken by a thread."""
        with self._ready:
            return sum(len(line) for line in self._lines.values())

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more jobs; `cancel_futures` cancels those not started; `wait` joins the threads."""
        with self._ready:
            self._is_shut_down = True
            if cancel_futures:
                for line in self._lines.values():
                    for future, *_ in line:
                        future.cancel()
                self._lines.clear()
            self._ready.notify_all()
        if wait and self._started:
            for thread in self._threads:
                thread.join()

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
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:  # the caller's to see, as ThreadPoolExecutor hands it over
                future.set_exception(error)
            else:
                future.set_result(result)
            del job, future, fn, args, kwargs  # the request's state is not held until the next job


class _CallerView(concurrent.futures.Executor):
    """One caller's door into a FairBuilder (what stream_events submits through)."""

    def __init__(self, builder: FairBuilder, caller: str) -> None:
        self._builder = builder
        self._caller = caller

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        return self._builder.submit(self._caller, fn, *args, **kwargs)
