"""The JSON of non-streamed answers the gateway holds, all callers together: serialized and not yet
all sent, bounded by --max-unread-answer-bytes.

NOTE: why bytes, checked before any work, and why a 503. Each caller's answers being written are
bounded in choices (twice --max-streams-per-caller), but callers are many (every address is one), and
a caller's worst is about 760 MiB of JSON (64 choices of 8,192 tokens with 20 alternatives each, 12 MiB
a choice). Choices would bound that memory badly: one without logprobs is a few KiB, one with them
twelve MiB; bytes are what runs the gateway out of memory. An answer's bytes are known only as it is
serialized (`choice_json`), after its decoding, so a request is refused before any decoder call while
the gateway already holds the bound, and a request admitted under it is served whole: answers admitted
together may pass the bound by what they hold, which the decoder's own stream bounds limit, rather than
a decoded answer being thrown away. The bound is the gateway's, not the caller's: a 503 with
Retry-After, as --max-large-bodies is, not the 429 of a caller's own share. A streamed answer holds a
chunk at a time and is never refused by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.gateway.errors import HttpError


@dataclass
class AnswerBytes:
    max_bytes: int  # --max-unread-answer-bytes
    num_bytes: int = 0  # held now: serialized, not yet all handed to the connection

    def take(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes

    def give_back(self, num_bytes: int) -> None:
        self.num_bytes -= num_bytes

    def refusal(self) -> HttpError | None:
        """A 503 for a non-streamed request while the answers held are at or over the bound."""
        if self.num_bytes < self.max_bytes:
            return None
        message = (
            f"the gateway holds {self.num_bytes} bytes of non-streamed answers being written, at or over "
            f"{self.max_bytes} (--max-unread-answer-bytes, all callers together); retry, or ask for a "
            f"streamed answer (stream: true), which holds none"
        )
        return HttpError(503, "service_unavailable", message, retry_after_s=1.0)
