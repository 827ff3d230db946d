"""A request message larger than its method could ever use, refused from its size before it is parsed.

Parsing is where an oversized message costs: 60 million token IDs (60 MB on the wire, inside the
64 MiB message limit) took 0.3 s of the event loop and 240 MB to parse, only for the count check to
refuse them. A method that knows its most useful size (the encoder's Embed: `max_input_tokens`
positions of text or IDs) refuses a larger message from its length, naming the top-level field that
holds most of it, found by walking the message's top-level tags without decoding any payload.

NOTE: bounded work. The walk runs on the event loop over bytes the caller shapes: 2 MB of two-byte
fields was a million tags for a Python loop (0.8-1.8 s on a busy 2-core host; 32 MB, 11-25 s), for
one refusal. It visits at most MAX_FIELDS_WALKED tags; a length-delimited payload, however long, is
skipped in one step, so the usual oversized request (one huge field among a few) still walks to its
end. Past the bound a field is named only if it already holds over half the request's bytes (no field
in the rest can outweigh it), else the request is; the message says the walk stopped short.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor

from .errors import InvalidArgument

LENGTH_DELIMITED = 2
FIXED_SIZES = {1: 8, 5: 4}  # wire type -> bytes
# Top-level tags walked at most: 0.6 us each on a busy 2-core host (3.6 us for a 10-byte tag and a 10-byte
# varint), so 0.6-3.6 ms for any request. A client's request has a few fields (a repeated one counts once
# per element), far fewer than this; bad_utf8.py walks as many.
MAX_FIELDS_WALKED = 1_000


@dataclass(frozen=True)
class _Largest:
    """What the walk found of the top-level field holding the most bytes."""

    number: int | None  # that field's number; None: the bytes do not walk, or no field is known to hold most
    is_complete: bool  # every field was walked; False: MAX_FIELDS_WALKED ran out first


def oversized(raw: bytes, max_bytes: int, descriptor: Descriptor | None) -> InvalidArgument:
    """The error for `raw`, a message of more than `max_bytes` bytes."""
    largest = _largest_field(raw)
    field = None
    if descriptor is not None and largest.number is not None:
        field = descriptor.fields_by_number.get(largest.number)
    description = (
        f"the request is {len(raw)} bytes; this method can use at most {max_bytes} "
        "(its longest useful input), so it was not parsed"
    )
    if not largest.is_complete:
        description += f"; it has over {MAX_FIELDS_WALKED} fields, and " + (
            f"the first {MAX_FIELDS_WALKED} name no field holding over half its bytes"
            if field is None
            else f"of the first {MAX_FIELDS_WALKED} this one holds over half its bytes"
        )
    return InvalidArgument(field.name if field is not None else "request", description)


def _largest_field(raw: bytes) -> _Largest:
    """The top-level field with the most bytes, from at most MAX_FIELDS_WALKED of its tags."""
    sizes: dict[int, int] = {}
    i = 0
    try:
        for _ in range(MAX_FIELDS_WALKED):
            if i >= len(raw):
                break
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
                return _Largest(None, is_complete=True)
            i += size if wire_type != 0 else 0
            if i > len(raw):
                return _Largest(None, is_complete=True)  # a length that runs past the end: not a message
            sizes[number] = sizes.get(number, 0) + size
    except IndexError:
        return _Largest(None, is_complete=True)
    is_complete = i >= len(raw)
    number = max(sizes, key=sizes.__getitem__) if sizes else None
    if number is not None and not is_complete and 2 * sizes[number] <= len(raw):
        number = None  # the fields not walked could hold more
    return _Largest(number, is_complete)


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
