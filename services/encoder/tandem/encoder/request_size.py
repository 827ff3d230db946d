"""An Embed request too large to be of use, refused from its size before it is parsed.

Parsing is where an oversized request costs (60 million token IDs: 0.3 s of the event loop and
240 MB), so a request longer than the most any input can use is refused unparsed, naming the
top-level field that holds most of its bytes (`tandem.client.oversized`). An image's field is
`image`, and where its data is over max_image_bytes that limit is the one it broke: the refusal names
`image.data` and max_image_bytes, as the check on a parsed image does, so one mistake reads as one
error whatever its size. Being the largest field proves no more than that (other fields may hold the
rest), so an image within max_image_bytes is named only as holding the most of the request's bytes. A
picture sent as text (a data: URL, base64) is named so here too, read from the image's first bytes. On
an encoder whose model takes no images the bound leaves images out, and any image, however large, is
refused as one that it could never take (FAILED_PRECONDITION, as a small one parsed is), not as over
a max_image_bytes that does not apply to it. (Past max_message_bytes gRPC refuses the message itself,
RESOURCE_EXHAUSTED naming no field; an image within max_image_bytes always fits, as EncoderConfig
allows no larger max_image_bytes.)
"""

from __future__ import annotations

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.client.oversized import FIXED_SIZES, LENGTH_DELIMITED, oversized, read_varint
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.encoder.vision.image_bytes import image_too_large, sent_as_text

TAKES_NO_IMAGES = "this encoder's model takes no images (serve a LLaVA or SmolVLM checkpoint)"
# The fields walked to find the image's bytes: a client sends a handful before them, and the walk is in
# Python over a request that may hold millions of tiny fields.
MAX_FIELDS_BEFORE = 16


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
            span = _image_data_span(raw)
            head = raw[span[0] : min(span[1], span[0] + 64)] if span is not None else b""
            as_text = sent_as_text(head)  # base64 is 4/3 of the bytes: those may fit
            info = None
            if span is not None and span[1] - span[0] > max_image_bytes:
                known = f"its image over max_image_bytes {max_image_bytes}"
                info = image_too_large(span[1] - span[0], max_image_bytes)
            else:
                known = f"over the {max_bytes} this method can use, its image holding the most of them"
            raise InvalidArgument(
                "image.data",
                f"the request is {len(raw)} bytes, {known}; it was not parsed"
                + (f", and it {as_text}" if as_text else ""),
                info=info,
            )
        raise error
    return encoder_pb2.EmbedRequest.FromString(raw)


def _image_data_span(raw: bytes) -> tuple[int, int] | None:
    """Where the request's `image.data` lies, found by walking tags as `oversized` does
    (EmbedRequest.image is field 8, Image.data field 1); None when it is not within
    MAX_FIELDS_BEFORE fields of the start or the bytes do not walk."""
    span = _field_span(raw, 0, len(raw), number=8)
    return _field_span(raw, *span, number=1) if span is not None else None


def _field_span(raw: bytes, start: int, end: int, number: int) -> tuple[int, int] | None:
    """Where the payload of the first length-delimited field `number` in raw[start:end] lies."""
    i = start
    try:
        for _ in range(MAX_FIELDS_BEFORE):
            if i >= end:
                return None
            tag, i = read_varint(raw, i)
            wire_type = tag & 7
            if wire_type == LENGTH_DELIMITED:
                size, i = read_varint(raw, i)
            elif wire_type == 0:
                _, i = read_varint(raw, i)
                size = 0
            else:
                size = FIXED_SIZES.get(wire_type, end)  # a group or worse: past the end
            if tag >> 3 == number and wire_type == LENGTH_DELIMITED:
                return (i, min(i + size, end))
            i += size
    except IndexError:
        return None
    return None
