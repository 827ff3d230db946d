"""The JSON of non-streamed answers the gateway holds, reserved when each request is admitted:
at most --max-unread-answer-bytes all callers together, --max-unread-answer-bytes-per-caller one's.

NOTE: why reserved at admission, and why a share per caller. Each caller's answers being written are
bounded in choices (twice --max-streams-per-caller), but callers are many (every address is one) and
a caller's worst is about 760 MiB of JSON (64 choices of 8,192 tokens with 20 alternatives each, 12 MiB
a choice); bytes, not choices, are what runs the gateway out of memory. An answer's bytes are known only
once it is serialized (`choice_json`), after its decoding, so counting them then made the bound a
threshold: requests admitted together, while little was serialized, held many times it (6.9 times
in a test). So a request reserves the most its answer can take (`answer_bound`) before any decoder
call, and is refused while that does not fit; once its answer is serialized the reservation is
settled to its real size, the rest given back, and all of it given back when the answer is written
or its connection ends. The bound is then exact, but for the text `answer_bound` assumes: an answer
whose text averages more than its 8 bytes a token holds its excess beyond its reservation.

The bound is the gateway's: a 503 with Retry-After, as --max-large-bodies is. Within it, each caller's
reservations are capped (a 429 naming its share, as --max-large-bodies-per-caller): a caller reading
its answers at a trickle holds them until --write-timeout-s between reads never passes, so without a
share one caller held the whole bound and every other caller's non-streamed requests were 503s for as
long as it liked. A request whose reservation alone is over the share could never be served: a 413
naming what makes it large. A streamed answer holds a chunk at a time and reserves nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tandem.gateway.errors import HttpError


@dataclass
class AnswerBytes:
    max_bytes: int  # --max-unread-answer-bytes
    max_bytes_per_caller: int  # --max-unread-answer-bytes-per-caller
    num_bytes: int = 0  # held now, all callers': reserved, or serialized and not yet all written
    per_caller: Counter[str] = field(default_factory=Counter)  # the same, each caller's

    def refusal(self, caller: str, num_bytes: int) -> HttpError | None:
        """A 429 when `caller`'s answers held and `num_bytes` more are over its share, a 503 when the
        gateway's are over its bound; None when a reservation of `num_bytes` fits both."""
        held = self.per_caller[caller]
        if held + num_bytes > self.max_bytes_per_caller:
            message = (
                f"this caller's non-streamed answers being written hold {held} bytes and this request's "
                f"may take {num_bytes} more, over {self.max_bytes_per_caller} "
                f"(--max-unread-answer-bytes-per-caller); read them first, or ask for a streamed answer "
                f"(stream: true), which holds none"
            )
            return HttpError(429, "rate_limit_error", message, retry_after_s=1.0)
        if self.num_bytes + num_bytes > self.max_bytes:
            message = (
                f"the gateway's non-streamed answers being written hold {self.num_bytes} bytes and this "
                f"request's may take {num_bytes} more, over {self.max_bytes} (--max-unread-answer-bytes, "
                f"all callers together); retry, or ask for a streamed answer (stream: true), which holds none"
            )
            return HttpError(503, "service_unavailable", message, retry_after_s=1.0)
        return None

    def reserve(self, caller: str, num_bytes: int) -> Reservation:
        """`num_bytes` held for `caller`'s answer (after `refusal` found none): `Reservation.release`
        gives them back."""
        reservation = Reservation(self, caller)
        reservation.take(num_bytes)
        return reservation

    def _take(self, caller: str, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        self.per_caller[caller] += num_bytes
        if not self.per_caller[caller]:
            del self.per_caller[caller]


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
        """`num_bytes` of the answer's JSON made: within the reservation, or counted beyond it."""
        self.num_serialized += num_bytes
        if self.num_serialized > self.num_held:
            self.take(self.num_serialized - self.num_held)

    def settle(self) -> None:
        """The answer is serialized: what it reserved beyond its JSON goes back."""
        self.take(self.num_serialized - self.num_held)

    def release(self) -> None:
        """Everything back: the answer was written, failed, or its connection ended. Idempotent."""
        self.take(-self.num_held)
