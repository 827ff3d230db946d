"""A picture's bytes against the bounds its Embed call must pass: the encoder's max_image_bytes (its
--max-image-bytes, or what its --max-message-bytes carries) and the services' --max-message-bytes the
gateway's channels are opened with.

Checked before the call, so the 413 names the body's part and the flag: passed on, gRPC's own refusal
("CLIENT: Sent message larger than max (17301514 vs. 16777216)") named neither. An encoder whose cap
is below what the gateway was told still refuses over gRPC; that refusal is named the same way
(`over_cap`). One over the encoder's max_image_bytes is refused only once the encoder, asked again,
still says so (`refusal_asking_again`, `encoder_info.py`): it may have restarted with a higher one.

NOTE: why the encoder's own refusal over its max_image_bytes is a 413 too. An encoder restarted with a
lower --max-image-bytes takes the gateway's check by (it holds the higher bound said before) and
refuses the picture itself, INVALID_ARGUMENT "image.data: N bytes exceed max_image_bytes M" (or,
refused unparsed, "... its image over max_image_bytes M; it was not parsed"): passed on, that was a 400
naming no part of the body, where the gateway's own check gives a 413 naming it. It is now the same
413 (`over_cap`), and the lower bound is held (`EncoderInfo.lowered`), so the next picture over it is
refused before any call."""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from tandem.client import error_reasons as reasons
from tandem.client.over_cap import over_cap as message_over_cap
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.client.status_details import status_details
from tandem.gateway.encoder_info import EncoderInfo, Metadata
from tandem.gateway.errors import HttpError

# The encoder's refusal of a picture over its max_image_bytes, read by its ErrorInfo (IMAGE_TOO_LARGE) first;
# by its wording only from an encoder that sends none (older), in either wording: parsed, "N bytes
# exceed max_image_bytes M" (`vision/image_bytes.py`, `read_image`), or a request over the most its Embed
# can use, refused unparsed, "the request is N bytes, its image over max_image_bytes M; it was not parsed"
# (`request_size.py`). Only the former was read: such a larger picture was a 400, the lower bound not held.
# The picture's size is read from the request sent: the unparsed wording gives the whole request's.
OVER_MAX_IMAGE_BYTES = re.compile(r"(?:bytes exceed|its image over) max_image_bytes (\d+)")


def over_max_image_bytes(num_bytes: int, max_image_bytes: int, where: str) -> HttpError:
    message = (
        f"{where}: the picture is {num_bytes} bytes, over the encoder's max_image_bytes "
        f"{max_image_bytes} (its --max-image-bytes, or what its --max-message-bytes carries)"
    )
    return HttpError(413, "invalid_request_error", message, where)


@dataclass(frozen=True)
class ImageBound:
    """The bounds an Embed call of one picture must pass."""

    max_image_bytes: int  # the encoder's (its GetModelInfo); 0 where it says none
    max_message_bytes: int  # the services' --max-message-bytes, as the gateway was told (its channels')

    def refusal(self, request: encoder_pb2.EmbedRequest, where: str) -> HttpError | None:
        """A 413 naming `where` (the body's part) and the flag when `request`'s picture is over a bound."""
        num_bytes = len(request.image.data)
        if self.is_over_max_image_bytes(request):
            return over_max_image_bytes(num_bytes, self.max_image_bytes, where)
        if (size := request.ByteSize()) > self.max_message_bytes:
            message = (
                f"{where}: the picture is {num_bytes} bytes, an Embed call of {size} bytes, over the "
                f"services' max_message_bytes {self.max_message_bytes} (--max-message-bytes)"
            )
            return HttpError(413, "invalid_request_error", message, where)
        return None

    def is_over_max_image_bytes(self, request: encoder_pb2.EmbedRequest) -> bool:
        return 0 < self.max_image_bytes < len(request.image.data)


async def refusal_asking_again(
    info: EncoderInfo,
    max_message_bytes: int,
    request: encoder_pb2.EmbedRequest,
    where: str,
    caller: Metadata = None,
) -> HttpError | None:
    """`ImageBound.refusal` of `request` under the bounds the encoder said (`info`) and the services'
    `max_message_bytes`; a picture over the encoder's max_image_bytes is asked about again first, and
    refused under what the encoder says now (what it said before, where it does not answer)."""
    bound = ImageBound((await info.get(caller)).max_image_bytes, max_message_bytes)
    if bound.is_over_max_image_bytes(request) and (now := await info.asked_again()) is not None:
        bound = ImageBound(now.max_image_bytes, max_message_bytes)
    return bound.refusal(request, where)


def over_cap(
    error: grpc.aio.AioRpcError, request: encoder_pb2.EmbedRequest, where: str, info: EncoderInfo
) -> HttpError | None:
    """gRPC's refusal of `request`'s Embed call over a side's message cap as a 413 naming `where`, read by
    the shared parser (`tandem.client.over_cap`): the request (a picture the check above let by, or the
    encoder's --max-message-bytes below the gateway's) or the reply (a text's rows, which no check before
    the call can count), whose cap, and what would shrink that one message (`_shrink`). And the encoder's
    refusal of a picture over a max_image_bytes lower than `info` held (then held).

    NOTE: a reply over a cap is a 413 here, where a Generate call's is a 500 (`errors.py`): an Embed
    reply's size is the input's rows alone, which the body chose, and the answer over
    --max-embeddings-bytes for the same cause is a 413 naming the input too."""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT and (max_image_bytes := _refused_over(error)):
        info.lowered(max_image_bytes)
        return over_max_image_bytes(len(request.image.data), max_image_bytes, where)
    if (over := message_over_cap(error)) is None:
        return None
    side = "gateway" if over.is_ours else "encoder"
    limit = f"the {side}'s --max-message-bytes of {over.max_bytes}"
    what = "the encoder's reply" if over.is_reply else "its Embed call"
    ways = [*_shrink(request, where, over.is_reply), f"start the {side} with a larger --max-message-bytes"]
    message = f"{where}: {what} is {over.num_bytes} bytes, over {limit}: {', or '.join(ways)}"
    return HttpError(413, "invalid_request_error", message, where)


def _refused_over(error: grpc.aio.AioRpcError) -> int | None:
    """The max_image_bytes the encoder refused a picture over; None where it refused something else."""
    said = status_details(error).metadata_of(reasons.ENCODER, reasons.IMAGE_TOO_LARGE)
    if said is not None:
        value = said.get(reasons.MAX_IMAGE_BYTES, "")
        return int(value) if value.isascii() and value.isdigit() else None
    worded = OVER_MAX_IMAGE_BYTES.search(error.details() or "")
    return int(worded[1]) if worded else None


def _shrink(request: encoder_pb2.EmbedRequest, where: str, is_reply: bool) -> list[str]:
    """What the caller can change in the body to shrink this one Embed call's message. Each embeddings
    input is its own call, so fewer inputs never shrink it (that was the advice once). A request is the
    input itself. A reply is the input's rows: one when pooled, whatever the input; else a text's or token
    IDs' as many as it is long, a picture's as many as the encoder makes whatever its size, and an
    embeddings body may pool them to one (a chat's picture may not)."""
    is_picture = request.HasField("image")
    if not is_reply:
        return ["send a smaller picture" if is_picture else "send a shorter input"]
    if request.pooling == encoder_pb2.POOLING_MEAN:
        return []
    ways = [] if is_picture else ["send a shorter input"]
    if where.startswith("input"):
        ways.append("pool its rows (tandem_pooling mean)")
    return ways
