"""Which string field of a request holds bytes that are not UTF-8, for a refusal that names it.

protobuf's parser refuses such a message ("String field had bad UTF-8") and names no field, so every
service answered `request: not a valid request message`, leaving the caller to guess which of its
strings was at fault. `bad_utf8_field` walks the wire format along the message's descriptor to the
first string field whose bytes do not decode, the one the parser stopped at, and gives its path as
the other refusals write it (`prompt[2].text`, `texts[1]`, `chat.template_kwargs.k[3]`,
`chat.template_kwargs["a b"]`: a string key as field_path.child_path spells it, an integer one `[7]`).

The path is that of the message the parser builds: a message field sent twice is merged, so a repeated
field's index goes on counting in its second chunk, but a map entry replaces an earlier one of its key and
a oneof member set after another starts empty, so their indexes start again; a map entry is named by its
key, and a Struct, a Value and a ListValue as the JSON they stand for, not by protobuf's own fields
(`fields`, `struct_value`).

NOTE: bounded work. It runs only on a request the parser has already refused, on the event loop, but such
a request is the caller's to shape: 20 KB of two-byte fields is 10,000 tags for a Python loop against
0.02 ms for the parser. The walk visits at most MAX_FIELDS_WALKED fields, skips every payload but a
string's (which it decodes, as the parser did) and a message's (which it enters), and gives up (None)
past the bound, on bytes that do not walk, or deeper than protobuf's own nesting limit.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from .field_path import MAX_KEY_CHARS, child_path
from .oversized import FIXED_SIZES, LENGTH_DELIMITED, read_varint

# Fields walked at most, over all levels: MIN_FIELDS_WALKED and one for each BYTES_PER_FIELD of the request,
# up to MAX_FIELDS_WALKED. A field costs the walk 0.4-1.7 us on a busy 2-core host (entering a message the
# most) and the parser 0.002-0.025 us, so a request of two-byte fields held the loop 150 times as long as
# its parse (10,000 fields in 20 KB: 12 ms); per byte the walk now costs at most 8 times the parse
# (0.1 us), and its fields at most about 1.7 ms a request. On top of that it decodes each string it walks
# once, as the parser did, at under twice the parse's cost (a 4 MiB string of CJK text before a bad byte:
# 3.0 ms against a 1.7 ms parse), and of a map key only what its name shows. A realistic request's strings
# and token IDs make its fields far longer than 16 bytes (a chat of 240 messages of 60 characters is 1,000
# fields in 17 KB); past the bound the refusal names the kind of field only.
MIN_FIELDS_WALKED = 64
BYTES_PER_FIELD = 16
MAX_FIELDS_WALKED = 1_000
MAX_DEPTH = 100  # protobuf's own recursion limit for nested messages
MAX_PATH_CHARS = 200  # a deeper path keeps its head and its tail

_STRUCT, _VALUE, _LIST = "google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"
_SIGNED = (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64)
_ZIGZAG = (FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64)
_SIGNED_FIXED = (FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_SFIXED64)


class _Unwalkable(Exception):
    """The bytes are not a message the walk can follow, or the walk ran past its bound."""


class _Walk:
    """One walk's state: its budget, and each repeated field's count so far in the message the parser
    builds that holds it. Messages are numbered as the parser makes them: every chunk of a singular message
    field merges into one (its number kept in `singular`), while each element of a repeated one, map
    entries included, is new, and so is a oneof member set after another member (which cleared it)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.budget = min(MAX_FIELDS_WALKED, MIN_FIELDS_WALKED + len(raw) // BYTES_PER_FIELD)
        self.num_messages = 1  # the request is message 0
        self.singular: dict[tuple[int, int], int] = {}  # (message, field number) -> its message field's
        self.chosen: dict[tuple[int, str], int] = {}  # (message, oneof name) -> field number set last
        self.counts: dict[tuple[int, int], int] = {}  # (message, field number) -> occurrences so far

    def fields(self, i: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(field number, wire type, payload start, payload end) of each field in raw[i:end]."""
        raw = self.raw
        while i < end:
            self.budget -= 1
            if self.budget < 0:
                raise _Unwalkable
            tag = raw[i]
            if tag < 0x80:  # the usual one-byte tag, without a call
                i += 1
            else:
                tag, i = read_varint(raw, i)
            number, wire_type = tag >> 3, tag & 7
            start = i
            if wire_type == 0:
                _, i = read_varint(raw, i)
            elif wire_type in FIXED_SIZES:
                i += FIXED_SIZES[wire_type]
            elif wire_type == LENGTH_DELIMITED:
                size, start = read_varint(raw, i)
                i = start + size
            else:
                raise _Unwalkable  # groups, or no wire type at all
            if i > end:
                raise _Unwalkable  # a field running past its message
            yield number, wire_type, start, i

    def message(
        self, i: int, end: int, descriptor: Descriptor, path: str, parsed: int, depth: int
    ) -> str | None:
        """The path of the first string in raw[i:end], a `descriptor` message at `path` that is the
        parser's message number `parsed`, that is not UTF-8."""
        if depth > MAX_DEPTH:
            raise _Unwalkable
        for number, wire_type, start, stop in self.fields(i, end):
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            if field.containing_oneof is not None:
                self.choose(parsed, field)
            if wire_type != LENGTH_DELIMITED:
                continue  # a scalar, or packed: no string in it
            if field.type == FieldDescriptor.TYPE_STRING:
                index = self.index(parsed, field)  # counted whether or not it decodes
                if not _decodes(self.raw, start, stop):
                    return self.child(path, descriptor, field, index)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                if field.message_type.GetOptions().map_entry:  # named by its key, never counted
                    entry = _join(path, field.name) if descriptor.full_name != _STRUCT else path
                    inner = self.keyed(entry, start, stop, field)
                else:
                    inner = self.child(path, descriptor, field, self.index(parsed, field))
                found = self.message(
                    start, stop, field.message_type, inner, self.made(parsed, field), depth + 1
                )
                if found is not None:
                    return found
        return None

    def made(self, parsed: int, field: FieldDescriptor) -> int:
        """The number of the message the parser puts this occurrence of message `field` of `parsed` in."""
        key = (parsed, field.number)
        if not field.is_repeated and key in self.singular:
            return self.singular[key]  # merged into the one made before
        self.num_messages += 1
        if not field.is_repeated:
            self.singular[key] = self.num_messages
        return self.num_messages

    def choose(self, parsed: int, field: FieldDescriptor) -> None:
        """Set oneof member `field` of `parsed`: where another member was set last, it starts empty."""
        key = (parsed, field.containing_oneof.name)
        if self.chosen.get(key, field.number) != field.number:
            self.singular.pop((parsed, field.number), None)  # a member is never repeated: no counts
        self.chosen[key] = field.number

    def index(self, parsed: int, field: FieldDescriptor) -> int | None:
        """The index of this occurrence of `field` in message `parsed` (None: not repeated)."""
        if not field.is_repeated:
            return None
        key = (parsed, field.number)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        return index

    def child(self, path: str, descriptor: Descriptor, field: FieldDescriptor, index: int | None) -> str:
        """The path of `field` (its `index`-th) of the `descriptor` message at `path`, as parsed."""
        if descriptor.full_name == _VALUE or descriptor.GetOptions().map_entry:
            return path  # a Value is its kind, a map entry's value is the entry (named by its key)
        name = _join(path, "" if descriptor.full_name == _LIST else field.name)
        return name if index is None else f"{name}[{index}]"

    def keyed(self, path: str, start: int, end: int, field: FieldDescriptor) -> str:
        """`path[key]` for the map entry raw[start:end] of map `field`: its key as the caller wrote it."""
        key_field = field.message_type.fields_by_number[1]
        key: object = "" if key_field.type == FieldDescriptor.TYPE_STRING else 0  # protobuf's default
        for number, wire_type, i, stop in self.fields(start, end):
            if number == 1:
                key = _key(self.raw, wire_type, i, stop, key_field.type)
        if isinstance(key, str):  # a Struct's (the protocol's one string-keyed map): `.k`, `["a b"]`
            return child_path(path, key)  # as the template-kwargs checks name the same key
        return f"{path}[{key}]"


def bad_utf8_field(raw: bytes, descriptor: Descriptor) -> str | None:
    """The path of the first string field of `raw` (a `descriptor` message) that is not UTF-8; None
    where the walk finds none within its bounds."""
    try:
        path = _Walk(raw).message(0, len(raw), descriptor, "", 0, 0)
    except (_Unwalkable, IndexError):
        return None
    if path is None or len(path) <= MAX_PATH_CHARS:
        return path
    half = MAX_PATH_CHARS // 2
    head, _ = _escape_around(path, half)
    _, tail = _escape_around(path, len(path) - half)
    return f"{path[:head]}...{path[tail:]}"


def _escape_around(path: str, cut: int) -> tuple[int, int]:
    """Where the JSON escape of a key that `cut` falls inside starts and ends; (cut, cut) outside one.

    A backslash in a path is always a key's (field names have none), and starts an escape unless it is
    the second of a `\\\\`, so an escape is found by looking back at most its own length (`\\u0001`: 6)."""
    for start in range(max(0, cut - 5), cut):
        if path[start] == "\\":
            before = start
            while before > 0 and path[before - 1] == "\\":
                before -= 1
            if (start - before) % 2 == 0:
                end = start + (6 if path[start + 1] == "u" else 2)
                if end > cut:
                    return start, end
    return cut, cut


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name


def _decodes(raw: bytes, start: int, end: int) -> bool:
    try:
        str(memoryview(raw)[start:end], "utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _key(raw: bytes, wire_type: int, start: int, end: int, key_type: int) -> object:
    """A map key from its payload: a string's first 4 * (MAX_KEY_CHARS + 1) bytes as text (bad bytes shown
    as U+FFFD), at least the MAX_KEY_CHARS + 1 characters that tell whether its name is cut; else the
    number."""
    if wire_type == LENGTH_DELIMITED:
        # Only what the name shows (and one character more, to tell whether it is cut), at most 4 bytes a
        # character: a 4 MiB key decoded whole held the loop 20-33 ms, where the parse stops at one byte.
        return str(raw[start : min(end, start + 4 * (MAX_KEY_CHARS + 1))], "utf-8", "replace")
    if wire_type == 0:
        value, _ = read_varint(raw, start)
        if key_type in _ZIGZAG:
            return (value >> 1) ^ -(value & 1)
        return value - (1 << 64) if key_type in _SIGNED and value >= 1 << 63 else value
    return int.from_bytes(raw[start:end], "little", signed=key_type in _SIGNED_FIXED)
