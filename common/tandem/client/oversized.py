"""A request message larger than its method could ever use, refused from its size before it is parsed.

Parsing is where an oversized message costs: 60 million token IDs (60 MB on the wire, inside the
64 MiB message limit) took 0.3 s of the event loop and 240 MB to parse, only for the count check to
refuse them. A method that knows its most useful size (the encoder's Embed: `max_input_tokens`
positions of text or IDs) refuses a larger message from its length, naming the top-level field that
holds most of it, found by walking the message's top-level tags without decoding any payload.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor

from .errors import InvalidArgument

LENGTH_DELIMITED = 2
FIXED_SIZES = {1: 8, 5: 4}  # wire type -> bytes


def oversized(raw: bytes, max_bytes: int, descriptor: Descriptor | None) -> InvalidArgument:
    """The error for `raw`, a message of more than `max_bytes` bytes."""
    field = _largest_field(raw, descriptor) or "request"
    return InvalidArgument(
        field,
        f"the request is {len(raw)} bytes; this method can use at most {max_bytes} "
        "(its longest useful input), so it was not parsed",
    )


def _largest_field(raw: bytes, descriptor: Descriptor | None) -> str | None:
    """The name of the top-level field with the most bytes, or None when the bytes do not walk."""
    sizes: dict[int, int] = {}
    i = 0
    try:
        while i < len(raw):
            tag, i = read_varint(raw, i)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == LENGTH_DELIMITED:
                size, i = read_varint(raw, i)
            elif wire_type == 0:
                start = i
                _, i = read_varint(raw, i)
                size = i - start
            elif wire_type in FIXED_SIZES:
                size = FIXED_SIZES[wire_type]
            else:
                return None
            i += size if wire_type != 0 else 0
            if i > len(raw):
                return None  # a length that runs past the end: not a message
            sizes[number] = sizes.get(number, 0) + size
    except IndexError:
        return None
    if not sizes:
        return None
    number = max(sizes, key=sizes.__getitem__)
    known = descriptor.fields_by_number.get(number) if descriptor is not None else None
    return known.name if known is not None else None


def read_varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
