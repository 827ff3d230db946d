"""A body's JSON values bounded from its raw bytes before it is parsed: never an undercount, and the
refusal names the field the values are in."""

from __future__ import annotations

import json

import pytest

from tandem.client.errors import InvalidArgument
from tandem.gateway.body_limits import COUNTED_BYTES, BodyLimits, count_values

LIMITS = BodyLimits.for_chat(256, 16)


def _values(value: object) -> int:
    """The JSON values in `value`, containers included: what the byte count must never fall below."""
    if isinstance(value, dict):
        return 1 + sum(_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_values(v) for v in value)
    return 1


@pytest.mark.parametrize(
    "body",
    [
        {"a": [1, 2, [3, {"b": [4, 5]}]], "c": {"d": 1, "e": [], "f": {}}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 7}] * 5},
        {"prompt": list(range(300))},
    ],
)
def test_the_byte_count_bounds_the_values_of_any_body(body: dict) -> None:
    raw = json.dumps(body).encode()
    assert raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1 >= _values(body)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "", "messages": [{"role": "user", "content": "hi"}] * 100_000}, "messages"),
        ({"model": "", "messages": [], "logit_bias": {str(i): 1.0 for i in range(300_000)}}, "logit_bias"),
        ({"model": "", "messages": [], "stop": ["x"] * 300_000}, "stop"),
        ({"model": "", "unknown": [[]] * 300_000}, "body"),
    ],
)
def test_a_body_too_wide_is_refused_unparsed_naming_its_wide_field(body: dict, field: str) -> None:
    raw = json.dumps(body).encode()
    assert len(raw) > COUNTED_BYTES  # counted a slice at a time: the refusal comes before the end
    with pytest.raises(InvalidArgument) as error:
        count_values(raw, LIMITS)
    assert error.value.field == field and "refused before parsing" in str(error.value)


def test_a_body_within_the_bound_passes_however_large_its_strings() -> None:
    rows = {"messages": [{"role": "user", "content": "A" * (50 * COUNTED_BYTES)}], "stop": ["a"] * 16}
    count_values(json.dumps(rows).encode(), LIMITS)
    exact = b"[" + b"," * (LIMITS.max_values - 1) + b"]"
    count_values(exact, LIMITS)
    with pytest.raises(InvalidArgument):
        count_values(exact + b",", LIMITS)
