"""A body's fields read as the type they must be (never a bool for a number), within the proto's
range, or InvalidArgument naming them."""

from __future__ import annotations

import math
import reprlib
import struct
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.common.model_name import echo
from tandem.gateway.body_limits import at_most

# The proto's unsigned ranges.
UINT32 = 2**32 - 1
UINT64 = 2**64 - 1
INT64_MIN = -(2**63)  # the least of vLLM's int64 seeds


def field(body: dict[str, Any], name: str, types: type | tuple[type, ...], path: str = "") -> Any:
    """`body[name]`, None when absent or null, else of `types` (a bool only where bool is one of them:
    JSON's true is no 1); InvalidArgument naming `path` + `name` otherwise."""
    value = body.get(name)
    if value is not None and (
        not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types)
    ):
        expected = " or ".join(t.__name__ for t in _as_tuple(types))
        raise InvalidArgument(f"{path}{name}", f"must be {expected}, got {type(value).__name__}")
    return value


# A refused value as an error shows it: its start, never all of it. Echoed whole, a 90 MB string in a
# field that must be a word came back as a message up to 3 times the body (repr, then JSON's escapes of
# every non-ASCII character), and a list nested 1,000 deep overflowed repr's recursion. A string is
# cut as the services cut theirs (`echo`: its start and its length); any other value by reprlib, which
# bounds each piece and the nesting, the whole cut to MAX_SHOWN characters.
MAX_SHOWN = 100
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = MAX_SHOWN
_SHOWN.maxlevel = 3


def shown(value: Any) -> str:
    """`value` as an error message shows it: its repr, cut to MAX_SHOWN characters and 3 levels."""
    if isinstance(value, str):
        return echo(value)
    text = _SHOWN.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def uint(body: dict[str, Any], name: str, low: int = 0, high: int = UINT32) -> int | None:
    """An integer field (never a bool) within [low, high]: the proto's unsigned range at most."""
    value = field(body, name, int)
    if value is not None and not low <= value <= high:
        raise InvalidArgument(name, f"must be in [{low}, {high}], got {shown(value)}")
    return value


def number(body: dict[str, Any], name: str) -> float | None:
    """A finite number (JSON has no NaN or Infinity; Python's parser accepts them, this does not)."""
    value = field(body, name, (int, float))
    if value is None:
        return None
    try:
        converted = float(value)
    except OverflowError:
        raise InvalidArgument(name, "is too large") from None
    if not math.isfinite(converted):
        raise InvalidArgument(name, f"must be a finite number, got {shown(value)}")
    return float32(converted, name, value)


def float32(value: float, name: str, sent: Any) -> float:
    """`value`, or InvalidArgument showing the number `sent` where the decoder's float32 would not
    read it as that number: past its range it read inf and refused "got inf", and below its least
    magnitude it read 0.0 (top_p 1e-46: "must be in (0, 1], got 0.0")."""
    rounded = struct.unpack("f", struct.pack("f", value))[0]  # inf past float32's range
    if math.isinf(rounded):
        raise InvalidArgument(
            name, f"{shown(sent)} overflows float32, the decoder's type (at most about 3.4e38)"
        )
    if value and not rounded:
        raise InvalidArgument(
            name,
            f"{shown(sent)} rounds to 0 in float32, the decoder's type (its least magnitude is 1.4e-45)",
        )
    return value


def token_ids(value: Any, path: str, max_ids: int) -> list[int] | None:
    """A non-empty list of token IDs (ints in the proto's range, no bools), or None if it is not one.
    Counted against `max_ids` before any element is looked at."""
    if (
        not isinstance(value, list)
        or not value
        or not isinstance(value[0], int)
        or isinstance(value[0], bool)
    ):
        return None
    at_most(path, len(value), max_ids, "token IDs")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    if min(value) < 0 or max(value) > UINT32:
        raise InvalidArgument(path, f"token IDs must be in [0, {UINT32}]")
    return value
