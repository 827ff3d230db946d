"""An Embed request too large to be of use, refused from its size before it is parsed.

Parsing is where an oversized request costs (60 million token IDs: 0.3 s of the event loop and
240 MB), so a request longer than the most any input can use is refused unparsed, naming the
top-level field that holds most of its bytes (`tandem.client.oversized`). An image's field is
`image`, and the limit it broke is its own: the refusal names `image.data` and max_image_bytes, as
the check on a parsed image does, so one mistake reads as one error whatever its size. On an encoder
whose model takes no images the bound leaves images out, and any image, however large, is refused as
one that it could never take (FAILED_PRECONDITION, as a small one parsed is), not as over a
max_image_bytes that does not apply to it. (Past
max_message_bytes gRPC refuses the message itself, RESOURCE_EXHAUSTED naming no field; an image within
max_image_bytes always fits, as EncoderConfig allows no larger max_image_bytes.)
"""

from __future__ import annotations

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.client.oversized import oversized
from tandem.client.pb.tandem.v1 import encoder_pb2

TAKES_NO_IMAGES = "this encoder's model takes no images (serve a LLaVA or SmolVLM checkpoint)"


def parse_embed_request(
    raw: bytes, max_bytes: int | None, max_image_bytes: int, takes_images: bool = True
) -> encoder_pb2.EmbedRequest:
    """`raw` parsed, or InvalidArgument (FailedPrecondition for an image the model cannot take),
    unparsed, when it is over `max_bytes` (None: no bound yet)."""
    if max_bytes is not None and len(raw) > max_bytes:
        error = oversized(raw, max_bytes, encoder_pb2.EmbedRequest.DESCRIPTOR)
        if error.field == "image" and not takes_images:
            raise FailedPrecondition("image", TAKES_NO_IMAGES)
        if error.field == "image":
            raise InvalidArgument(
                "image.data",
                f"the request is {len(raw)} bytes, its image over max_image_bytes {max_image_bytes}; "
                "it was not parsed",
            )
        raise error
    return encoder_pb2.EmbedRequest.FromString(raw)
