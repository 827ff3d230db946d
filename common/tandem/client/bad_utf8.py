"""Which string field of a request holds bytes that are not UTF-8, for a refusal that names it.

protobuf's parser refuses such a message ("String field had bad UTF-8") and names no field, so every
service answered `request: not a valid request message`, leaving the caller to guess which of its
strings was at fault. `bad_utf8_field` walks the wire format along the message's descriptor to the
first string field whose bytes do not decode, the one the parser stopped at, and gives its path as
the other refusals write it (`prompt[2].text`, `texts[1]`).

NOTE: bounded work. It runs only on a request the parser has already refused, but such a request is
the caller's to shape: 10 MB of two-byte fields is 5 million tags for a Python loop (about 8 s
of the event loop). The walk visits at most MAX_FIELDS_WALKED fields, skips every payload but a string's
(which it decodes, as the parser did) and a message's (which it enters), and gives up (None) past
the bound, on bytes that do not walk, or deeper than protobuf's own nesting limit.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from .oversized import FIXED_SIZES, LENGTH_DELIMITED, read_varint

# Fields walked at most, over all levels: about 1.6 us each on a busy 2-core host, 16 ms in all, where
# the parse that refused a 7 MB request of 1.4 million segments took 100 ms (a 10 MB string is walked
# in 1.2 ms). A request with more fields before its bad one (5,000 prompt segments of text) is refused
# naming the kind of field only.
MAX_FIELDS_WALKED = 10_000
MAX_DEPTH = 100  # protobuf's own recursion limit for nested messages


class _Unwalkable(Exception):
    """The bytes are not a message the walk can follow, or the walk ran past its bound."""


def bad_utf8_field(raw: bytes, descriptor: Descriptor) -> str | None:
    """The path of the first string field of `raw` (a `descriptor` message) that is not UTF-8; None
    where the walk finds none within its bounds."""
    budget = [MAX_FIELDS_WALKED]
    try:
        return _walk(raw, 0, len(raw), descriptor, "", budget, 0)
    except (_Unwalkable, IndexError):
        return None


def _walk(
    raw: bytes, i: int, end: int, descriptor: Descriptor, prefix: str, budget: list[int], depth: int
) -> str | None:
    if depth > MAX_DEPTH:
        raise _Unwalkable
    counts: dict[int, int] = {}  # field number -> occurrences so far, a repeated field's index
    while i < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unwalkable
        tag, i = read_varint(raw, i)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, i = read_varint(raw, i)
            continue
        if wire_type in FIXED_SIZES:
            i += FIXED_SIZES[wire_type]
            continue
        if wire_type != LENGTH_DELIMITED:
            raise _Unwalkable  # groups, or no wire type at all
        size, i = read_varint(raw, i)
        start, i = i, i + size
        if i > end:
            raise _Unwalkable
        field = descriptor.fields_by_number.get(number)
        if field is None or field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
            continue
        index = counts.get(number, 0)
        counts[number] = index + 1
        path = f"{prefix}{field.name}[{index}]" if field.is_repeated else f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                str(memoryview(raw)[start:i], "utf-8")
            except UnicodeDecodeError:
                return path
        else:
            found = _walk(raw, start, i, field.message_type, f"{path}.", budget, depth + 1)
            if found is not None:
                return found
    if i != end:
        raise _Unwalkable  # a fixed-size field running past its message
    return None
