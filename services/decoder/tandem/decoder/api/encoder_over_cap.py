"""An Embed message gRPC refused for its size: whose --max-message-bytes it was over, and what mends it.

Its own module, apart from the fetching in `encoder_parts.py`: gRPC says which cap refused a message
only in its status's text ("CLIENT: Received message larger than max (131087 vs. 65536)"), so telling
this decoder's cap from the encoder's, and a request from a reply, is a parser of that text, with its
own tests, that no other part of a fetch needs. Whichever it was, it is the caller's input too long,
which no retry mends: `encoder_parts` makes it INVALID_ARGUMENT on the caller's field, where it read
RESOURCE_EXHAUSTED "encoder ... is full" with a RetryInfo.
"""

from __future__ import annotations

import dataclasses
import re

import grpc

# gRPC's status for a message over a cap: the side whose cap it is, which way, "(size vs. cap)", within its
# own words ("Stream removed (CLIENT: ...)").
OVER_CAP_DETAILS = re.compile(
    r"(CLIENT|SERVER): (Sent|Received) message larger than max \((\d+) vs\. (\d+)\)"
)


@dataclasses.dataclass(frozen=True)
class OverCap:
    """A message gRPC refused for its size: the caller's input too long, which no retry mends."""

    is_ours: bool  # this decoder's cap (--max-message-bytes) refused it, not the encoder's own
    is_reply: bool  # the reply carrying the rows, not the request carrying the input
    num_bytes: int
    max_bytes: int

    def description(self, max_message_bytes: int) -> str:
        """Which message was over whose --max-message-bytes, and what mends it; `max_message_bytes` is
        this decoder's."""
        if self.is_ours and self.is_reply:
            return rows_too_large(max_message_bytes, f"a reply of {self.num_bytes} bytes")
        if self.is_ours:
            # An image just under the cap in the Generate call: its Embed call adds a few hundred bytes.
            return (
                f"its Embed request of {self.num_bytes} bytes (the input and the call's own fields) is "
                f"larger than this decoder's --max-message-bytes {self.max_bytes} allows: send a smaller "
                "input, or start the decoder with a larger --max-message-bytes"
            )
        what = (
            f"its rows are larger than the encoder's own --max-message-bytes {self.max_bytes} allows "
            f"(a reply of {self.num_bytes} bytes)"
            if self.is_reply
            else f"its Embed request of {self.num_bytes} bytes is larger than the encoder's "
            f"--max-message-bytes {self.max_bytes} allows"
        )
        return f"{what}: send a smaller input, or start the encoder with a larger --max-message-bytes"


def over_cap(error: BaseException) -> OverCap | None:
    """The message a call failed for, larger than a cap; None when it failed otherwise. CLIENT is this
    decoder's channel (its --max-message-bytes), SERVER the encoder's: "SERVER: Received" is the request
    over the encoder's cap, "CLIENT: Received" the reply over this decoder's."""
    if not isinstance(error, grpc.aio.AioRpcError) or error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    match = OVER_CAP_DETAILS.search(error.details() or "")
    if match is None:
        return None
    side, way, num_bytes, max_bytes = match.groups()
    is_ours = side == "CLIENT"
    return OverCap(is_ours, is_ours == (way == "Received"), int(num_bytes), int(max_bytes))


def rows_too_large(max_message_bytes: int, detail: str) -> str:
    """Why rows over this decoder's --max-message-bytes are refused, whichever way they came: as bytes
    over gRPC's receive cap, or through shared memory, which passes it."""
    return (
        f"the encoder's rows are larger than this decoder's --max-message-bytes {max_message_bytes} "
        f"allows ({detail}): send a shorter input, or start the decoder with a larger --max-message-bytes"
    )
