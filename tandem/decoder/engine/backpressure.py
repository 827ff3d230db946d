"""How far a stream's reader is behind its request, so that the engine can pause the request.

NOTE: what "behind" means. gRPC takes a stream's messages as fast as the peer's HTTP/2 window
allows; a reader that stops reading fills its window, grpc's writes then wait, and the stream's
events pile up in its queue. Counted here: Delta events the engine has handed the stream and the
stream has not yet taken. Past `max_unread` the engine pauses the request (it leaves the batch and
frees its KV blocks, `Scheduler.pause`); once the reader takes what piled up, the engine resumes it
(recomputing from the prefix cache, as after a preemption) and its tokens are the same as if it had
never stopped. A stream whose reader keeps up never pauses: every take empties the queue.

Two counters, each written by one thread (the engine thread counts what it hands over, the reader
what it takes), so neither needs a lock; a stale read only delays a pause or a resume by one step,
and the reader wakes the engine once it has caught up with a paused request.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_UNREAD_EVENTS = 64  # Delta events a stream may hold untaken before its request pauses


class ReaderProgress:
    def __init__(self, wake: Callable[[], None], max_unread: int = MAX_UNREAD_EVENTS) -> None:
        self.max_unread = max_unread
        self._wake = wake  # tells the engine loop to look again (it may be idle, every request paused)
        self.num_handed = 0  # engine thread only
        self.num_taken = 0  # reader only
        self.is_paused = False  # engine thread only

    @property
    def num_unread(self) -> int:
        return self.num_handed - self.num_taken

    def handed(self, num_events: int = 1) -> None:
        """Engine thread: events went to the stream."""
        self.num_handed += num_events

    def taken(self, num_events: int) -> None:
        """Reader: events left the stream's queue; wake the engine if that resumes the request."""
        self.num_taken += num_events
        if self.is_paused and self.has_caught_up:
            self._wake()

    @property
    def is_far_behind(self) -> bool:
        return self.num_unread > self.max_unread

    @property
    def has_caught_up(self) -> bool:
        return self.num_unread <= self.max_unread // 2
