"""Structured output as a body asks for it: OpenAI's `response_format` or one of vLLM's `guided_*`
extras, as one StructuredOutput."""

from __future__ import annotations

import json
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.body_limits import MAX_GUIDED_CHOICES, at_most
from tandem.gateway.fields import shown


def structured_output(body: dict[str, Any], request: decoder_pb2.GenerateRequest) -> str | None:
    """OpenAI's `response_format` (json_schema, json_object) and vLLM's `guided_*` extras -> one
    StructuredOutput; two at once is INVALID_ARGUMENT. Returns the body field that set it."""
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
    guided_json = body.get("guided_json")
    if guided_json is not None:
        if not isinstance(guided_json, dict | bool | str):  # true and false are schemas too
            raise InvalidArgument("guided_json", "must be a JSON schema (an object, a boolean or its text)")
        text = guided_json if isinstance(guided_json, str) else _schema_text(guided_json, "guided_json")
        chosen.append(("guided_json", decoder_pb2.StructuredOutput(json_schema=text)))
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidArgument(name, "must be a string")
            chosen.append((name, decoder_pb2.StructuredOutput(**{kind: value})))
    guided_choice = body.get("guided_choice")
    if guided_choice is not None:
        if not isinstance(guided_choice, list):
            raise InvalidArgument("guided_choice", "must be a list of strings")
        at_most("guided_choice", len(guided_choice), MAX_GUIDED_CHOICES, "choices")
        if not all(isinstance(c, str) for c in guided_choice):
            raise InvalidArgument("guided_choice", "must be a list of strings")
        choices = decoder_pb2.StructuredChoices(choices=guided_choice)
        chosen.append(("guided_choice", decoder_pb2.StructuredOutput(choice=choices)))
    if len(chosen) > 1:
        names = ", ".join(name for name, _ in chosen)
        raise InvalidArgument(chosen[1][0], f"one structured output per request, got {names}")
    if not chosen:
        return None
    request.structured.CopyFrom(chosen[0][1])
    return chosen[0][0]


def _schema_text(schema: dict[str, Any] | bool, where: str) -> str:
    """A parsed schema as the JSON text the decoder compiles. Written out again, a schema nested just
    under the depth Python's parser stops at passes it (the parser ran on a shallower stack) and then
    overflows the writer's recursion: refused as the body's nesting is."""
    try:
        return json.dumps(schema)
    except RecursionError:
        raise InvalidArgument(where, "nests too deep") from None
