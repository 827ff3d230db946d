"""The JSON of non-streamed answers the gateway holds while they are written: at most
--max-unread-answer-bytes all callers together, --max-unread-answer-bytes-per-caller one caller's.

NOTE: what is bounded, and why an answer waits rather than being refused. An answer's JSON is made
once it is decoded (`choice_json`) and held until all of it is written or its connection ends; a
caller reading at a trickle (never past --write-timeout-s) holds it as long as it likes, and callers
are many (every address is one). So an answer reserves its JSON's most bytes, computed from its real
decoded tokens (`answer_bound`), just before it is serialized, checked and taken in one step (no await
between), settled to the real JSON once serialized, and given back when written or its connection
ends. Decoding holds nothing here: the memory of answers being decoded is bounded by the streams a
caller may open (--max-streams-per-caller). A reservation made at admission, from the request's most
tokens, held a 128k-context request's (context - 1) tokens' worth for its whole decoding: 21 such
requests a caller, 63 the gateway, or none at all with top_logprobs 20.

An answer that does not fit waits, its decoded work kept, first in, first out, woken as bytes are
given back, for up to --write-timeout-s: then refused, naming what held it (`_Held`): its caller's
share, or its caller's earlier answer waiting on it, a 429 naming --max-unread-answer-bytes-per-caller;
the gateway's bound, or an earlier answer waiting on it, a 503 naming --max-unread-answer-bytes; both
with Retry-After. The caller's share is checked first: a waiter it holds (whether or not the gateway's
bound would take it now) holds back only its own caller's later answers; one that fits its caller's
share but not the gateway's bound holds back every answer after it, so a large answer is not overtaken
for ever by small ones. An answer larger than its caller's share alone is written when its caller holds
nothing and it fits the gateway's bound. One larger than the gateway's bound alone is refused at once
(413): queued, it could be written only when no caller held any bytes, and held every caller's answers
behind it until then (a caller keeping its own answer unread kept it so for --write-timeout-s).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from tandem.gateway.errors import HttpError, Refused


class _Held(Enum):
    """What keeps a waiter waiting, so its refusal names it."""

    CALLER_SHARE = "its caller's share"  # its caller's answers being written, with it, are over the share
    CALLER_QUEUE = "its caller's earlier waiter"  # behind its own caller's answer that waits
    GATEWAY_BOUND = "the gateway's bound"  # all callers' answers being written, with it, are over the bound
    GATEWAY_QUEUE = "an earlier waiter on the gateway's bound"  # behind one held by the gateway's bound


@dataclass
class _Waiter:
    caller: str
    num_bytes: int
    granted: asyncio.Future[None]


@dataclass
class AnswerBytes:
    max_bytes: int  # --max-unread-answer-bytes
    max_bytes_per_caller: int  # --max-unread-answer-bytes-per-caller
    num_bytes: int = 0  # held now, all callers': reserved, or serialized and not yet all written
    per_caller: Counter[str] = field(default_factory=Counter)  # the same, each caller's
    waiters: deque[_Waiter] = field(default_factory=deque)  # answers waiting for bytes, in arrival order

    def fits_caller(self, caller: str, num_bytes: int) -> bool:
        """Within `caller`'s share, or the caller holds nothing (an answer over the share alone)."""
        held = self.per_caller[caller]
        return held == 0 or held + num_bytes <= self.max_bytes_per_caller

    def fits_gateway(self, num_bytes: int) -> bool:
        """Within the gateway's bound (an answer over it alone is refused before it waits)."""
        return self.num_bytes + num_bytes <= self.max_bytes

    async def reserve(self, caller: str, num_bytes: int, timeout_s: float) -> Reservation:
        """`num_bytes` held for `caller`'s answer, once they fit (see the note); Refused (429 or 503)
        after `timeout_s` of waiting; a 413 at once when it is over the gateway's bound alone. Cancelled
        while waiting, it holds nothing and leaves no waiter."""
        if num_bytes > self.max_bytes:
            raise Refused(self._too_large(num_bytes))
        waiter = _Waiter(caller, num_bytes, asyncio.get_running_loop().create_future())
        self.waiters.append(waiter)
        self._grant()  # taken at once when it fits and nothing before it waits on the same bound
        if not waiter.granted.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(waiter.granted)
            except TimeoutError:
                if not waiter.granted.done():  # else granted as its wait ended: written after all
                    refusal = self._refusal(waiter, timeout_s)  # what holds it, while it is still queued
                    self._leave(waiter)
                    raise Refused(refusal) from None
            except BaseException:  # cancelled: the caller went
                if waiter.granted.done():  # granted as it went: the bytes back
                    self._take(caller, -num_bytes)
                else:
                    self._leave(waiter)
                raise
        return Reservation(self, caller, num_held=num_bytes)

    def _leave(self, waiter: _Waiter) -> None:
        """`waiter` stops waiting, holding nothing; one held behind it may fit now."""
        waiter.granted.cancel()
        self.waiters.remove(waiter)
        self._grant()

    def _grant(self) -> None:
        """Every waiter that fits now, in order, takes its bytes (see `_holds`)."""
        for waiter, held_by in self._holds():
            if held_by is None:
                self.waiters.remove(waiter)
                self._take(waiter.caller, waiter.num_bytes)
                waiter.granted.set_result(None)

    def _holds(self) -> Iterator[tuple[_Waiter, _Held | None]]:
        """Each waiter, in order, with what holds it now (None: it fits), checked as each is reached, so
        a grant made before the next step counts. Its caller's share first: a waiter it holds holds its
        caller's later answers; one that fits its caller's share but not the gateway's bound, every
        later answer."""
        held_callers: set[str] = set()
        gateway_held = False
        for waiter in list(self.waiters):
            if waiter.caller in held_callers:
                yield waiter, _Held.CALLER_QUEUE
            elif not self.fits_caller(waiter.caller, waiter.num_bytes):
                held_callers.add(waiter.caller)
                yield waiter, _Held.CALLER_SHARE
            elif gateway_held:
                yield waiter, _Held.GATEWAY_QUEUE
            elif not self.fits_gateway(waiter.num_bytes):
                gateway_held = True
                yield waiter, _Held.GATEWAY_BOUND
            else:
                yield waiter, None

    def _refusal(self, waiter: _Waiter, timeout_s: float) -> HttpError:
        """A 429 when `waiter`'s caller's share or queue holds it, else a 503 (the gateway's bound or
        queue), its numbers those it waits on now."""
        held_by = next((held_by for queued, held_by in self._holds() if queued is waiter), None)
        caller, num_bytes = waiter.caller, waiter.num_bytes
        waited = f"for {timeout_s:g} s (--write-timeout-s)"
        if held_by in (_Held.CALLER_SHARE, _Held.CALLER_QUEUE):
            if held_by is _Held.CALLER_QUEUE:
                why = (
                    f"this answer ({num_bytes} bytes) waited behind this caller's earlier answer, itself "
                    f"waiting on this caller's share: its non-streamed answers being written hold "
                    f"{self.per_caller[caller]} bytes of {self.max_bytes_per_caller}"
                )
            elif num_bytes > self.max_bytes_per_caller:
                why = (
                    f"this answer takes {num_bytes} bytes, over {self.max_bytes_per_caller} alone, so it is "
                    f"written only when this caller's other answers being written (holding "
                    f"{self.per_caller[caller]} bytes) are all read"
                )
            else:
                why = (
                    f"this caller's non-streamed answers being written hold {self.per_caller[caller]} bytes "
                    f"and this answer takes {num_bytes} more, over {self.max_bytes_per_caller}"
                )
            message = (
                f"{why} (--max-unread-answer-bytes-per-caller) {waited}; read them first, or ask for a "
                f"streamed answer (stream: true), which holds none"
            )
            return HttpError(429, "rate_limit_error", message, retry_after_s=1.0)
        if held_by is _Held.GATEWAY_QUEUE:
            why = (
                f"this answer ({num_bytes} bytes) waited behind an earlier answer, itself waiting on the "
                f"gateway's bound: the non-streamed answers being written hold {self.num_bytes} bytes of "
                f"{self.max_bytes}"
            )
        else:
            why = (
                f"the gateway's non-streamed answers being written hold {self.num_bytes} bytes and this "
                f"answer takes {num_bytes} more, over {self.max_bytes}"
            )
        message = (
            f"{why} (--max-unread-answer-bytes, all callers together) {waited}; retry, or ask for a "
            f"streamed answer (stream: true), which holds none"
        )
        return HttpError(503, "service_unavailable", message, retry_after_s=1.0)

    def _too_large(self, num_bytes: int) -> HttpError:
        """A 413: an answer over the gateway's bound alone is never written."""
        message = (
            f"this non-streamed answer's JSON alone takes up to {num_bytes} bytes, over {self.max_bytes} "
            f"(--max-unread-answer-bytes, all callers' answers being written together); ask for fewer "
            f"choices (n), tokens (max_tokens) or alternatives (top_logprobs, logprobs), or a streamed "
            f"answer (stream: true), which holds none"
        )
        return HttpError(413, "invalid_request_error", message)

    def _take(self, caller: str, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        self.per_caller[caller] += num_bytes
        if not self.per_caller[caller]:
            del self.per_caller[caller]
        if num_bytes < 0:
            self._grant()


@dataclass
class Reservation:
    """One answer's bytes among the gateway's: reserved, then settled to what its JSON takes."""

    held: AnswerBytes
    caller: str
    num_held: int = 0  # counted in `held` for this answer now
    num_serialized: int = 0  # its JSON made so far

    def take(self, num_bytes: int) -> None:
        self.held._take(self.caller, num_bytes)
        self.num_held += num_bytes

    def hold(self, num_bytes: int) -> None:
        """`num_bytes` of the answer's JSON made: within the reservation (its bound is an upper bound;
        were it passed, the excess is counted as made)."""
        self.num_serialized += num_bytes
        if self.num_serialized > self.num_held:
            self.take(self.num_serialized - self.num_held)

    def settle(self) -> None:
        """The answer is serialized: what it reserved beyond its JSON goes back."""
        self.take(self.num_serialized - self.num_held)

    def release(self) -> None:
        """Everything back: the answer was written, failed, or its connection ended. Idempotent."""
        self.take(-self.num_held)
