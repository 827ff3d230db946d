"""How much memory the live matchers of structured output may hold: in all, and per caller.

NOTE: why a budget. Each constrained request, waiting, paused or running, holds a matcher of its own
(structured.py says why none is shared), built before it is queued, and nothing else counted them: 90
held-open unread streams of `regex a{300}{190}` grew the decoder by 1,281 MB (plain streams 57 MB),
about 20 MB a matcher. So each matcher is charged, when built, against the engine's total and its
caller's (a connection, or a bearer token: `Request.caller`, as for prompt logprobs), and one over
either is refused RESOURCE_EXHAUSTED naming its field (`structured.regex`, ...) and the limit, before
it is queued. The charge is given back when the request's constraint is collected, whichever way the
request ended (finished, cancelled, failed, preempted and dropped): the charge lives exactly as long
as the matcher's memory does.

llguidance says nothing of a matcher's size, so the charge is estimated from the CPU time its build
took (the matcher and its first mask, on the building thread): a matcher's memory is mostly the
regular expressions its lexer built, and building them is what the time pays for. Measured with
SmolLM2's vocabulary on a busy 2-core machine (glibc's in-use bytes before and after the build, and
the build's thread CPU time): `a{300}{190}` 20.3 MB in 56-69 ms, `a{300}{100}` 10.9 MB in 26-32 ms,
an allOf of 3 anyOf of 10 objects 11.4 MB in 94-123 ms, `[\\w .]{1,1000}` 0.8 MB in 3.5 ms, ordinary
JSON schemas and json_object 0.1-0.3 MB in 0.5-0.8 ms (growing to 0.3-1.4 MB over 300 random tokens
of answer): 110-390 MB per CPU second. The charge is MIN_MATCHER_BYTES, which covers an ordinary
matcher and its growth, plus BYTES_PER_BUILD_CPU_SECOND (above the highest rate measured) for each
second of its build: `a{300}{190}` is charged about 32 MiB, an ordinary schema 2.4 MiB. What a matcher
grows by while decoding, its lexer states, is charged as it grows, a tranche at a time past what the
floor covers (grammar_growth.py), and a running request whose growth is refused fails alone.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, InvalidArgument, ResourceExhausted

MIB = 1 << 20
MIN_MATCHER_BYTES = 2 * MIB  # an ordinary matcher, 0.2 MB built and up to 1.4 MB after 300 tokens
BYTES_PER_BUILD_CPU_SECOND = 512 * MIB  # measured 110-390 MB per CPU second of building
# 256 concurrent ordinary JSON schemas are about 620 MiB of charges: neither limit refuses them, and a
# gateway's requests, which may all be one caller, fit too; about 32 of `a{300}{190}` (650 MB) do.
MAX_BYTES = 2048 * MIB
MAX_BYTES_PER_CALLER = 1024 * MIB


def estimated_bytes(build_cpu_seconds: float) -> int:
    """A matcher's charge, from the CPU time its build and first mask took."""
    return MIN_MATCHER_BYTES + int(BYTES_PER_BUILD_CPU_SECOND * max(0.0, build_cpu_seconds))


class GrammarMemoryBudget:
    """Matcher bytes charged, in all and per caller. Thread-safe: building threads reserve, and a
    constraint's collection (any thread) releases."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_bytes_per_caller: int = MAX_BYTES_PER_CALLER) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_caller = max_bytes_per_caller
        self._held: Counter[str] = Counter()
        self._total = 0
        self._lock = threading.Lock()

    def held(self, caller: str | None = None) -> int:
        """Bytes charged: `caller`'s, or everyone's."""
        with self._lock:
            return self._total if caller is None else self._held[caller]

    def reserve(self, caller: str, field: str, nbytes: int, held_by_it: int = 0) -> Callable[[], None]:
        """Charges `nbytes` to `caller`; returns what gives them back (call it once). Raises
        ResourceExhausted naming `field` where the caller's or the engine's matchers hold too much,
        InvalidArgument where this one alone is over a limit: no wait would let it in, and a retry
        (RESOURCE_EXHAUSTED says when) would be refused for ever. `held_by_it`: what the same matcher
        is charged already, where `nbytes` is its growth (grammar_growth.py), counted in "alone"."""
        limit = min(self.max_bytes_per_caller, self.max_bytes)
        if held_by_it + nbytes > limit:
            what = (
                f"its matcher alone needs about {_mib(nbytes)} of memory (estimated from its build's CPU "
                "time)"
            )
            if held_by_it:
                what = (
                    f"its matcher alone would hold about {_mib(held_by_it + nbytes)} of memory "
                    f"({_mib(held_by_it)} charged already, {_mib(nbytes)} more for its growth)"
                )
            raise InvalidArgument(field, f"{what}, over the {_mib(limit)} a caller's live grammars may hold")
        with self._lock:
            if self._held[caller] + nbytes > self.max_bytes_per_caller:
                raise ResourceExhausted(
                    f"{field}: this caller's live grammars already hold about {_mib(self._held[caller])} "
                    f"of matcher memory; this one needs about {_mib(nbytes)} more and the limit is "
                    f"{_mib(self.max_bytes_per_caller)} per caller; "
                    "end a constrained stream or wait for one to end",
                    retry_after_s=1.0,
                    info=_info("caller", self._held[caller], nbytes, self.max_bytes_per_caller),
                )
            if self._total + nbytes > self.max_bytes:
                raise ResourceExhausted(
                    f"{field}: the decoder's live grammars already hold about {_mib(self._total)} of matcher "
                    f"memory; this one needs about {_mib(nbytes)} more and the limit is "
                    f"{_mib(self.max_bytes)} in all",
                    retry_after_s=1.0,
                    info=_info("decoder", self._total, nbytes, self.max_bytes),
                )
            self._held[caller] += nbytes
            self._total += nbytes
        return lambda: self._release(caller, nbytes)

    def _release(self, caller: str, nbytes: int) -> None:
        with self._lock:
            self._total -= nbytes
            self._held[caller] -= nbytes
            if not self._held[caller]:
                del self._held[caller]


def _info(scope: str, held: int, nbytes: int, limit: int) -> ErrorInfo:
    return reasons.decoder_info(
        reasons.GRAMMAR_MEMORY,
        {
            reasons.SCOPE: scope,
            reasons.HELD_BYTES: held,
            reasons.NEEDED_BYTES: nbytes,
            reasons.MAX_BYTES: limit,
        },
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:,.0f} MiB"
