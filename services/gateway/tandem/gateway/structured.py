"""Structured output as a body asks for it: OpenAI's `response_format`, vLLM's `structured_outputs`
or one of its older `guided_*` extras, as one StructuredOutput."""

from __future__ import annotations

import json
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.body_limits import MAX_GUIDED_CHOICES, at_most
from tandem.gateway.fields import shown


def structured_output(body: dict[str, Any], request: decoder_pb2.GenerateRequest) -> str | None:
    """OpenAI's `response_format` (json_schema, json_object), vLLM's `structured_outputs` and its older
    `guided_*` extras -> one StructuredOutput; two at once is INVALID_ARGUMENT. Returns the body field
    that set it."""
    chosen: list[tuple[str, decoder_pb2.StructuredOutput]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):  # it said "response_format.type: ... got None"
            raise InvalidArgument(
                "response_format", f'must be an object {{"type": ...}}, got {type(response_format).__name__}'
            )
        kind = response_format.get("type")
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict | bool):  # true and false are schemas, as for guided_json
                raise InvalidArgument(
                    "response_format.json_schema.schema", "must be a JSON schema (an object or a boolean)"
                )
            text = _schema_text(schema, "response_format.json_schema.schema")
            chosen.append(("response_format", decoder_pb2.StructuredOutput(json_schema=text)))
        elif kind == "json_object":
            chosen.append(("response_format", decoder_pb2.StructuredOutput(json_object=True)))
        elif kind != "text":
            raise InvalidArgument(
                "response_format.type", f"must be text, json_object or json_schema, got {shown(kind)}"
            )
    for kind in ("json", "regex", "grammar", "choice"):
        if (value := body.get(f"guided_{kind}")) is not None:
            chosen.append((f"guided_{kind}", _constraint(kind, value, f"guided_{kind}")))
    chosen.extend(_structured_outputs(body.get("structured_outputs")))
    if len(chosen) > 1:
        names = ", ".join(name for name, _ in chosen)
        raise InvalidArgument(chosen[1][0], f"one structured output per request, got {names}")
    if not chosen:
        return None
    request.structured.CopyFrom(chosen[0][1])
    return chosen[0][0]


# vLLM's StructuredOutputsParams (>= 0.12, where guided_* are gone): the constraints Tandem has, and
# the options that hold here whatever their value (one backend: there is nothing to fall back to).
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_HELD_OPTIONS = ("disable_fallback",)
MAX_KEY_CHARS = 64  # a key named in an error's field as it is; a longer or odder one is quoted and cut


def _structured_outputs(value: Any) -> list[tuple[str, decoder_pb2.StructuredOutput]]:
    """vLLM's `structured_outputs` object -> its one constraint as (`structured_outputs.<key>`, a
    StructuredOutput), or none; its keys Tandem has no counterpart of are refused unless null or false
    (vLLM's defaults), never dropped. A constraint's false is refused as its other wrong values are,
    but json_object's (a bool)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise InvalidArgument("structured_outputs", f"must be an object, got {type(value).__name__}")
    for key, option in value.items():
        if key not in _KINDS and key not in _HELD_OPTIONS and option not in (None, False):
            if key.isidentifier() and len(key) <= MAX_KEY_CHARS:  # vLLM's own (structural_tag, ...)
                raise InvalidArgument(f"structured_outputs.{key}", "is not supported")
            raise InvalidArgument("structured_outputs", f"{shown(key)} is not supported")
    disable_fallback = value.get("disable_fallback")
    if disable_fallback is not None and not isinstance(disable_fallback, bool):
        raise InvalidArgument("structured_outputs.disable_fallback", "must be a boolean")
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise InvalidArgument("structured_outputs.json_object", "must be a boolean")
    # json_object false asks for nothing, as null does: vLLM types it a bool and acts on it only when
    # true. Every other kind's false is a value: vLLM types them str, dict or list and refuses false,
    # where dropping it answered free text; here regex, grammar and choice refuse it as not their type
    # and json reads it as the schema false, which the decoder refuses as guided_json's.
    given = [
        kind
        for kind in _KINDS
        if value.get(kind) is not None and not (kind == "json_object" and value[kind] is False)
    ]
    if len(given) > 1:
        raise InvalidArgument(
            f"structured_outputs.{given[1]}", f"one structured output per request, got {', '.join(given)}"
        )
    if not given:
        return []
    name = f"structured_outputs.{given[0]}"
    return [(name, _constraint(given[0], value[given[0]], name))]


def _constraint(kind: str, value: Any, name: str) -> decoder_pb2.StructuredOutput:
    """One constraint as a guided_* field or a structured_outputs key gives it (`kind`: json, regex,
    grammar, choice or json_object), its errors naming `name`."""
    if kind == "json":
        if not isinstance(value, dict | bool | str):  # true and false are schemas too
            raise InvalidArgument(name, "must be a JSON schema (an object, a boolean or its text)")
        text = value if isinstance(value, str) else _schema_text(value, name)
        return decoder_pb2.StructuredOutput(json_schema=text)
    if kind == "choice":
        if not isinstance(value, list):
            raise InvalidArgument(name, "must be a list of strings")
        at_most(name, len(value), MAX_GUIDED_CHOICES, "choices")
        if not all(isinstance(c, str) for c in value):
            raise InvalidArgument(name, "must be a list of strings")
        return decoder_pb2.StructuredOutput(choice=decoder_pb2.StructuredChoices(choices=value))
    if kind == "json_object":
        return decoder_pb2.StructuredOutput(json_object=True)
    if not isinstance(value, str):
        raise InvalidArgument(name, "must be a string")
    return decoder_pb2.StructuredOutput(**{kind: value})


def _schema_text(schema: dict[str, Any] | bool, where: str) -> str:
    """A parsed schema as the JSON text the decoder compiles. Written out again, a schema nested just
    under the depth Python's parser stops at passes it (the parser ran on a shallower stack) and then
    overflows the writer's recursion: refused as the body's nesting is."""
    try:
        return json.dumps(schema)
    except RecursionError:
        raise InvalidArgument(where, "nests too deep") from None
