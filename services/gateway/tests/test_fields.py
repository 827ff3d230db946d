"""A refused value is shown in its error cut short: a caller sending megabytes where a word belongs
gets back a message of a line, not its value again (repr and JSON's escapes made it up to 3 times
larger), and a value nested deeper than repr can recurse is refused, not a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.client.errors import InvalidArgument
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.chat_request import chat_request
from tandem.gateway.completion_request import completion_request
from tandem.gateway.embed_request import embed_request
from tandem.gateway.fields import MAX_SHOWN, shown

LIMITS = BodyLimits.for_chat(256, 16)
EMBED_LIMITS = BodyLimits.for_embeddings(64)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
ROWS = {"dtype": "float32", "shape": [1, 4], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}
HUGE = "\u00e9" * 1_000_000  # 2 MB of UTF-8; 6 MB as JSON escapes them


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


DEEP = _nested(5000)  # past repr's recursion limit


def _user(part: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [part]}]}


ECHOED = {
    "a chat part's type": (chat_request, _user({"type": HUGE}), "messages[0].content[0]"),
    "a message's role": (chat_request, {"messages": [{"role": HUGE, "content": "a"}]}, "messages[0].role"),
    "a logit_bias value": (chat_request, CHAT | {"logit_bias": {"1": HUGE}}, "logit_bias"),
    "a logit_bias key": (chat_request, CHAT | {"logit_bias": {HUGE: 1}}, "logit_bias"),
    "a logit_bias value nested deep": (chat_request, CHAT | {"logit_bias": {"1": DEEP}}, "logit_bias"),
    "response_format's type": (
        chat_request, CHAT | {"response_format": {"type": HUGE}}, "response_format.type"
    ),
    "rows' dtype": (
        chat_request,
        _user({"type": "tandem_embeddings", "embeddings": ROWS | {"dtype": HUGE}}),
        "messages[0].content[0].embeddings.dtype",
    ),
    "rows' shape": (
        chat_request,
        _user({"type": "tandem_embeddings", "embeddings": ROWS | {"shape": [HUGE] * 2}}),
        "messages[0].content[0].embeddings.shape",
    ),
    "encoding_format": (embed_request, {"input": "a", "encoding_format": HUGE}, "encoding_format"),
    "tandem_pooling": (embed_request, {"input": "a", "tandem_pooling": DEEP}, "tandem_pooling"),
    "a chat part's type nested deep": (chat_request, _user({"type": DEEP}), "messages[0].content[0]"),
    # JSON's integers have no bound: Python's parser takes 4,300 digits.
    "max_tokens, an integer of 4,001 digits": (chat_request, CHAT | {"max_tokens": 10**4000}, "max_tokens"),
    "n, an integer of 4,001 digits": (chat_request, CHAT | {"n": 10**4000}, "n"),
    "top_k, an integer of 4,001 digits": (chat_request, CHAT | {"top_k": -(10**4000)}, "top_k"),
    "temperature, 4,001 digits": (chat_request, CHAT | {"temperature": 10**4000}, "temperature"),
}  # fmt: skip


@pytest.mark.parametrize("name", ECHOED)
def test_a_refused_value_is_named_and_shown_cut_short(name: str) -> None:
    convert, body, field = ECHOED[name]
    limits = EMBED_LIMITS if convert is embed_request else LIMITS
    with pytest.raises(InvalidArgument) as error:
        convert(body, limits)
    assert error.value.field == field
    assert len(str(error.value)) < 200 + len(field), str(error.value)[:300]


def test_a_short_value_is_shown_whole_and_a_long_one_says_it_was_cut() -> None:
    assert shown("tool") == "'tool'" and shown(None) == "None" and shown([1, 2]) == "[1, 2]"
    assert shown("\ud800") == "'\\ud800'"  # a lone surrogate shown escaped, never encoded
    for value in (HUGE, DEEP, {"a": HUGE}, [HUGE] * 100, 10**4000):
        text = shown(value)
        assert len(text) <= MAX_SHOWN and "..." in text


def _schema_in(field: str, schema: Any) -> dict[str, Any]:
    """A body's fields asking for `schema` through `field`: vLLM's guided_json or OpenAI's
    response_format."""
    if field == "guided_json":
        return {"guided_json": schema}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_a_schema_nested_past_the_writers_recursion_is_refused_naming_it(field: str) -> None:
    """The parser takes a schema nested a little under its own limit; writing it back out for the
    decoder recursed past Python's limit (a RecursionError: a 500)."""
    schema: dict[str, Any] = {}
    for _ in range(5000):
        schema = {"a": schema}
    extra = _schema_in(field, schema)
    with pytest.raises(InvalidArgument) as error:
        completion_request({"prompt": "a"} | extra, LIMITS)
    expected = "guided_json" if field == "guided_json" else "response_format.json_schema.schema"
    assert error.value.field == expected and "nests too deep" in str(error.value)


@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_a_boolean_schema_is_a_schema_in_either_field(field: str) -> None:
    """JSON Schema's `true` (any JSON value) and `false` (none) are schemas: guided_json refused them
    as not an object while response_format's schema took them; the decoder then answers `true` and
    refuses `false` in its own words (f397bc1)."""
    for schema in (True, False):
        extra = _schema_in(field, schema)
        request = completion_request({"prompt": "a"} | extra, LIMITS)
        assert request.requests[0].structured.json_schema == json.dumps(schema)


@pytest.mark.parametrize(
    ("field", "schema", "takes"),
    [
        ("guided_json", 5, "(an object, a boolean or its text)"),
        ("response_format", "{}", "(an object or a boolean)"),
        ("response_format", None, "(an object or a boolean)"),
    ],
)
def test_a_schema_of_another_type_is_refused_naming_what_each_field_takes(
    field: str, schema: Any, takes: str
) -> None:
    # response_format's refusal said "a JSON schema object" though it takes true and false as well.
    extra = _schema_in(field, schema)
    with pytest.raises(InvalidArgument) as error:
        completion_request({"prompt": "a"} | extra, LIMITS)
    assert error.value.field == (
        "guided_json" if field == "guided_json" else "response_format.json_schema.schema"
    )
    assert f"must be a JSON schema {takes}" in str(error.value)
