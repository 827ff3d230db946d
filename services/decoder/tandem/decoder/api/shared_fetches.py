"""Fetches running now, by key, so that one asked for again while it runs is awaited, not made again.

NOTE: one call for many waiters, each as if the call were its own. A fetch asked for while one of the
same key runs joins it (`asyncio.shield`: a waiter cancelled leaves), and gets its result or its
error. The call is cancelled only when every waiter has left, and forgotten then or when it ends, so
a later fetch never joins one that nobody waits for. A call runs with its first waiter's time: a
waiter with time left after the call ran out of it (`ran_out`) starts the fetch again with its own.
Event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(eq=False)
class _Fetch(Generic[T]):
    key: Hashable
    task: asyncio.Task[T]  # the call: settles with the result, or the error
    deadline: float  # loop time at which the call's time (its first waiter's) runs out
    num_waiting: int = 0  # waiters awaiting it; the last one to leave before it ends cancels it


class SharedFetches(Generic[T]):
    def __init__(self) -> None:
        self._running: dict[Hashable, _Fetch[T]] = {}
        self.num_started = 0  # calls made
        self.num_joined = 0  # fetches that awaited a call already running instead

    async def fetch(
        self,
        key: Hashable,
        timeout_s: float,
        call: Callable[[float], Awaitable[T]],  # makes the call, given the seconds it may take
        ran_out: Callable[[BaseException], bool],  # whether an error says the call's time ran out
    ) -> T:
        """The result of the call running for `key`, or of `call(timeout_s)` made now; its error as raised."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            running = self._running.get(key)
            if running is None or running.task.done():
                running = self._running[key] = _Fetch(key, asyncio.ensure_future(call(timeout_s)), deadline)
                running.task.add_done_callback(lambda _, ended=running: self._forget(ended))
                self.num_started += 1
            else:
                self.num_joined += 1
            running.num_waiting += 1
            try:
                return await asyncio.shield(running.task)
            except Exception as error:
                if (
                    ran_out(error)
                    and running.deadline < deadline
                    and (timeout_s := deadline - loop.time()) > 0
                ):
                    continue  # the call ran out of its first waiter's time: this one calls with its own
                raise
            finally:
                running.num_waiting -= 1
                if running.num_waiting == 0 and not running.task.done():
                    self._forget(running)
                    running.task.cancel()

    def _forget(self, running: _Fetch[T]) -> None:
        if self._running.get(running.key) is running:
            del self._running[running.key]
