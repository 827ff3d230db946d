"""A chat body's chat_template_kwargs: bounded as the decoder bounds them, before the Struct is built, and
free of what the body itself refuses."""

from __future__ import annotations

import time

import pytest
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.template_kwargs import template_kwargs


def _built(kwargs: dict) -> decoder_pb2.ChatPrompt:
    chat = decoder_pb2.ChatPrompt()
    template_kwargs(kwargs, chat)
    return chat


def _refusal(kwargs: dict) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as error:
        _built(kwargs)
    return error.value


def _nested(kinds: str) -> dict:
    """The top object, then an object (o) or a list (l) in it for each further letter of `kinds`."""
    value: object = True
    for kind in reversed(kinds[1:]):
        value = {"a": value} if kind == "o" else [value]
    return {"a": value}


def test_fields_are_counted_at_every_depth_as_the_decoder_counts_them() -> None:
    # Only the top level was counted: the decoder's 256 counts nested ones, so this reached it built.
    widest = {"a": list(range(255))}  # 256 fields: its key's value and each element
    assert json_format.MessageToDict(_built(widest).template_kwargs) == widest
    error = _refusal({"a": list(range(256))})
    assert error.field == "chat_template_kwargs"
    assert str(error) == (
        "chat_template_kwargs: holds more than the limit of 256 fields, nested ones included"
    )


def test_a_wide_kwargs_is_refused_without_reading_it_all() -> None:
    # 520,000 numbers fit a 1 MiB body, converted on the gateway's loop: building their Struct took
    # 0.67-0.82 s before the decoder refused it. The count stops past the limit.
    wide = {"a": [0] * 520_000}
    started = time.perf_counter()
    assert _refusal(wide).field == "chat_template_kwargs"
    assert time.perf_counter() - started < 0.1  # the walk takes ~50 µs; a busy host may deschedule it


def _parses(kinds: str) -> bool:
    """Whether the decoder's protobuf parser reads a Generate call carrying `_nested(kinds)` (built with
    no check of the gateway's)."""
    request = decoder_pb2.GenerateRequest()
    request.chat.template_kwargs.update(_nested(kinds))
    try:
        return decoder_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    except DecodeError:
        return False


def _accepted(kinds: str) -> bool:
    try:
        _built(_nested(kinds))
    except InvalidArgument as error:
        assert str(error) == (
            "chat_template_kwargs: nests deeper than the decoder's protobuf parser reads (each object "
            "counts 3 of its 99 levels, each list 2: 33 objects, or an object and 48 lists)"
        )
        return False
    return True


@pytest.mark.parametrize(
    "kinds",
    ["o" * 33, "o" * 34, "o" + "l" * 48, "o" + "l" * 49, "oo" + "l" * 46, "oo" + "l" * 47, "o" * 32 + "l"]
    + ["o" + "l" * 10 + "o" * 25, "o" + "l" * 10 + "o" * 26, "ol" + "o" * 31, "ol" + "o" * 32],
)
def test_kwargs_nest_as_deep_as_the_decoders_parser_reads(kinds: str) -> None:
    # Each object is 3 protobuf levels (Struct, map entry, Value) of upb's 100, a list 2 (ListValue,
    # Value): 34 objects were sent and the decoder's parse failed, named `request`; and counting a list
    # as an object refused 37 lists, which the decoder reads, as past what it reads.
    assert _accepted(kinds) == _parses(kinds)


def test_a_kwarg_may_not_carry_what_the_body_refuses() -> None:
    # vLLM merges the kwargs over its own tools and continue_final_message, so a template reads them as
    # those: here the body's refusals, which a kwarg passed (Qwen3's template rendered the tools).
    assert _refusal({"tools": [{"type": "function"}]}).field == "chat_template_kwargs.tools"
    assert _refusal({"tools": 0}).field == "chat_template_kwargs.tools"
    assert _refusal({"continue_final_message": True}).field == "chat_template_kwargs.continue_final_message"
    assert _refusal({"chat_template": "{{ x }}"}).field == "chat_template_kwargs.chat_template"
    quiet = {"tools": [], "continue_final_message": False, "chat_template": None, "functions": [{"a": 1}]}
    assert json_format.MessageToDict(_built(quiet).template_kwargs) == quiet


def test_an_integer_a_double_cannot_hold_exactly_is_refused_naming_its_path() -> None:
    # The Struct holds doubles: 2**53 + 1 reached the template as 2**53, silently (review 7, F8).
    for value, path in (
        ({"seed": 2**53 + 1}, "chat_template_kwargs.seed"),
        ({"a": [1, {"b": -(2**53) - 1}]}, "chat_template_kwargs.a[1].b"),
        ({"a b": [2**64]}, 'chat_template_kwargs["a b"][0]'),
        ({"a": 10**400}, "chat_template_kwargs.a"),
    ):
        error = _refusal(value)
        assert error.field == path
        assert (
            str(error)
            == f"{path}: is an integer past ±2^53 (9007199254740992), the most a double holds exactly"
        )
    edges = {"a": [2**53, -(2**53)], "b": 1e300, "c": True}
    assert json_format.MessageToDict(_built(edges).template_kwargs) == edges
