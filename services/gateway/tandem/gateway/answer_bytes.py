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
given back, for up to --write-timeout-s: then a 429 naming the caller's share (when that is what it
waits on) or a 503 naming the gateway's bound, with Retry-After. A waiter held by its own caller's
share holds no other caller's answers back; one held by the gateway's bound holds back those after it,
so a large answer is not overtaken for ever by small ones. An answer larger than a caller's share alone
is written when its caller holds nothing and it fits the gateway's bound; one larger than the gateway's
bound alone when the gateway holds nothing: no answer is refused for its size alone.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field

from tandem.gateway.errors import HttpError, Refused


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
        """Within the gateway's bound, or the gateway holds nothing (an answer over it alone)."""
        return self.num_bytes == 0 or self.num_bytes + num_bytes <= self.max_bytes

    async def reserve(self, caller: str, num_bytes: int, timeout_s: float) -> Reservation:
        """`num_bytes` held for `caller`'s answer, once they fit (see the note); Refused (429 or 503)
        after `timeout_s` of waiting. Cancelled while waiting, it holds nothing and leaves no waiter."""
        waiter = _Waiter(caller, num_bytes, asyncio.get_running_loop().create_future())
        self.waiters.append(waiter)
        self._grant()  # taken at once when it fits and nothing before it waits on the same bound
        if not waiter.granted.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(waiter.granted)
            except BaseException as error:  # a timeout or a cancellation (the caller went)
                if waiter.granted.done():  # granted as it ended: give the bytes back
                    self._take(caller, -num_bytes)
                else:
                    waiter.granted.cancel()
                    self.waiters.remove(waiter)
                self._grant()  # one held behind it may fit now
                if isinstance(error, TimeoutError):
                    raise Refused(self._refusal(caller, num_bytes, timeout_s)) from None
                raise
        return Reservation(self, caller, num_held=num_bytes)

    def _grant(self) -> None:
        """Every waiter that fits now, in order, takes its bytes; one held by the gateway's bound holds
        those after it, one held by its caller's share holds only its caller's after it."""
        held_callers: set[str] = set()
        for waiter in list(self.waiters):
            if waiter.caller in held_callers:
                continue
            if not self.fits_gateway(waiter.num_bytes):
                return
            if not self.fits_caller(waiter.caller, waiter.num_bytes):
                held_callers.add(waiter.caller)
                continue
            self.waiters.remove(waiter)
            self._take(waiter.caller, waiter.num_bytes)
            waiter.granted.set_result(None)

    def _refusal(self, caller: str, num_bytes: int, timeout_s: float) -> HttpError:
        """A 429 when `caller`'s share is what the answer waited on, else a 503 (the gateway's bound)."""
        if not self.fits_caller(caller, num_bytes):
            message = (
                f"this caller's non-streamed answers being written hold {self.per_caller[caller]} bytes and "
                f"this answer takes {num_bytes} more, over {self.max_bytes_per_caller} "
                f"(--max-unread-answer-bytes-per-caller) for {timeout_s:g} s (--write-timeout-s); read "
                f"them first, or ask for a streamed answer (stream: true), which holds none"
            )
            return HttpError(429, "rate_limit_error", message, retry_after_s=1.0)
        message = (
            f"the gateway's non-streamed answers being written hold {self.num_bytes} bytes and this "
            f"answer takes {num_bytes} more, over {self.max_bytes} (--max-unread-answer-bytes, all "
            f"callers together) for {timeout_s:g} s (--write-timeout-s); retry, or ask for a streamed "
            f"answer (stream: true), which holds none"
        )
        return HttpError(503, "service_unavailable", message, retry_after_s=1.0)

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
