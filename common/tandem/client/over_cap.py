"""A message gRPC refused as over a --max-message-bytes: whose cap it was, and which way it went.

gRPC says this only in its status's text ("CLIENT: Received message larger than max (131087 vs.
65536)"), within its own words ("Stream removed (...)"). The side is whose cap refused it: CLIENT is the
calling side's channel, SERVER the service called. The way is that side's: "Received" at the client is
the reply, "Received" at the server the request. Both the decoder (its Embed calls to an encoder) and the
gateway (its Generate calls to a decoder) name the message and the flag from this one reading: the
gateway's first copy matched the sizes only, and named a reply over its own cap as the request over the
decoder's.
"""

from __future__ import annotations

import dataclasses
import re

import grpc

# gRPC's status for a message over a cap: the side whose cap it is, which way, "(size vs. cap)".
OVER_CAP_DETAILS = re.compile(
    r"(CLIENT|SERVER): (Sent|Received) message larger than max \((\d+) vs\. (\d+)\)"
)


@dataclasses.dataclass(frozen=True)
class OverCap:
    """A message gRPC refused for its size: the caller's input, or what it asked for, too large."""

    is_ours: bool  # the calling side's cap (its channel's --max-message-bytes), not the service's
    is_reply: bool  # the service's reply, not the request
    num_bytes: int
    max_bytes: int


def over_cap(error: BaseException) -> OverCap | None:
    """The message a call failed for, larger than a cap; None when it failed otherwise."""
    if not isinstance(error, grpc.aio.AioRpcError) or error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    match = OVER_CAP_DETAILS.search(error.details() or "")
    if match is None:
        return None
    side, way, num_bytes, max_bytes = match.groups()
    is_ours = side == "CLIENT"
    # The client receives replies and the server requests: a reply is "Received" at the client.
    return OverCap(is_ours, is_ours == (way == "Received"), int(num_bytes), int(max_bytes))
