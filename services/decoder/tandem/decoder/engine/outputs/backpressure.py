"""How far a stream's reader is behind its request, so that the engine can pause the request.

NOTE: what "behind" means. gRPC takes a stream's messages as fast as the peer's HTTP/2 window
allows; a reader that stops reading fills its window, grpc's writes then wait, and the stream's
events pile up in its queue. Counted here: the tokens of the Delta events the engine has handed the
stream and the stream has not yet taken, and their prompt-logprob entries (one per position: a
request that scores a long prompt pauses right after that Delta until it is taken); a Delta with
neither counts as one. Tokens, not events: a request that asks for a Delta every `stream_interval` steps
(at most MAX_STREAM_INTERVAL) would otherwise run that many times further ahead of a reader who
stopped before it paused. Past `max_unread` the engine pauses the request (it leaves the batch and
frees its KV blocks, `Scheduler.pause`); once the reader takes what piled up, the engine resumes it
(recomputing from the prefix cache, as after a preemption) and its tokens are the same as if it had
never stopped. A stream whose reader keeps up never pauses: every take empties the queue.

Two counters, each written by one thread (the engine thread counts what it hands over, the reader
what it takes), so neither needs a lock; a stale read only delays a pause or a resume by one step,
and the reader wakes the engine once it has caught up with a paused request.
"""

from __future__ import annotations

from collections.abc import Callable, Sized

MAX_UNREAD_TOKENS = 64  # tokens a stream may hold untaken before its request pauses
# Steps per Delta at most (OutputOptions.stream_interval): a request sending nothing for longer
# could never fall behind, so never pause, however long its reader had stopped.
MAX_STREAM_INTERVAL = 16


def unread_weight(token_ids: Sized, prompt_logprobs: Sized) -> int:
    """What a Delta adds to its stream's unread count: its tokens and prompt positions, at least one."""
    return max(1, len(token_ids) + len(prompt_logprobs))


class ReaderProgress:
    def __init__(self, wake: Callable[[], None], max_unread: int = MAX_UNREAD_TOKENS) -> None:
        self.max_unread = max_unread
        self._wake = wake  # tells the engine loop to look again (it may be idle, every request paused)
        self.num_handed = 0  # engine thread only
        self.num_taken = 0  # reader only
        self.is_paused = False  # engine thread only
        self._releases: list[Callable[[], None]] = []  # what the stream gives back when it ends

    def hold(self, release: Callable[[], None]) -> None:
        """Something reserved for this stream (a prompt-logprob budget) until `close`."""
        self._releases.append(release)

    def close(self) -> None:
        """The stream ended: give back everything it held (once)."""
        releases, self._releases = self._releases, []
        for release in releases:
            release()

    @property
    def num_unread(self) -> int:
        return self.num_handed - self.num_taken

    def handed(self, weight: int = 1) -> None:
        """Engine thread: a Delta of `weight` (unread_weight) went to the stream."""
        self.num_handed += weight

    def taken(self, weight: int) -> None:
        """Reader: Deltas of `weight` in all left the stream's queue; wake the engine if that resumes
        the request."""
        self.num_taken += weight
        if self.is_paused and self.has_caught_up:
            self._wake()

    @property
    def is_far_behind(self) -> bool:
        return self.num_unread > self.max_unread

    @property
    def has_caught_up(self) -> bool:
        return self.num_unread <= self.max_unread // 2
