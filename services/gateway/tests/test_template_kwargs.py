"""A chat body's chat_template_kwargs: bounded as the decoder bounds them, before the Struct is built, and
free of what the body itself refuses."""

from __future__ import annotations

import time

import pytest
from google.protobuf import json_format

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.body_limits import MAX_TEMPLATE_DEPTH
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
    assert time.perf_counter() - started < 0.01


def test_kwargs_nest_as_deep_as_the_decoders_parser_reads() -> None:
    # Each object is 3 protobuf levels (Struct, map entry, Value) of upb's 100: 34 objects were built and
    # sent, and the decoder's parse failed 'Exceeded upb_DecodeOptions_MaxDepth', named `request`.
    for kinds in ("o" * MAX_TEMPLATE_DEPTH, "o" * 32 + "l", "ol" + "o" * 31, "l" * MAX_TEMPLATE_DEPTH):
        request = decoder_pb2.GenerateRequest(chat=_built(_nested(kinds)))
        assert decoder_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    for kinds in ("o" * (MAX_TEMPLATE_DEPTH + 1), "o" * MAX_TEMPLATE_DEPTH + "l"):
        error = _refusal(_nested(kinds))
        assert str(error) == (
            "chat_template_kwargs: nests deeper than the limit of 33 objects and lists (the top one "
            "counted), the most the decoder's protobuf parser reads"
        )


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
