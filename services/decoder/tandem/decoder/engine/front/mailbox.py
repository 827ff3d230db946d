"""Events from the engine thread to an asyncio loop, with at most one loop wakeup per burst.

Each `call_soon_threadsafe` writes the loop's self-pipe and costs a wakeup; one per event per
stream adds up at 32 streams (a step emits an event for every running request). The mailbox queues
events under a lock and schedules a single drain for everything posted before the loop gets to it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], Any]] = []
        self._is_drain_scheduled = False

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """Any thread: deliver `item` to `queue` on the loop, in posting order."""
        with self._lock:
            self._pending.append((queue, item))
            if self._is_drain_scheduled:
                return
            self._is_drain_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to read these events
            with self._lock:
                self._pending.clear()
                self._is_drain_scheduled = False

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._is_drain_scheduled = False
        for queue, item in pending:
            queue.put_nowait(item)
