"""A chat body's `chat_template_kwargs` -> the chat's `template_kwargs` Struct: bounded as the decoder
bounds it, before anything is built, and holding nothing the body itself refuses.

NOTE: why the gateway walks the kwargs first. A body under 1 MiB is converted on the event loop, and a
Struct costs about 7 times a messages body per byte: one list of 520,000 numbers took 0.67-0.82 s to
build, every stream and /health waiting, before the decoder refused it at 256 fields. So the fields are
counted the decoder's way (`api/request_width.py`: every value of an object or a list, at every depth)
and the walk stops past the limit. The same walk bounds the depth the decoder's protobuf parser reads:
each object is three of upb's 100 levels (Struct, map entry, Value), a list two, so 34 nested objects
were built and sent, and the decoder refused the call as unparsable, naming `request`. Each is counted
at its own cost: counting a list as an object refused 37 nested lists, which the decoder reads. The walk also
refuses an integer a double cannot hold exactly (past 2**53), naming its path: the Struct would round
it, and the template see another integer (2**53 + 1 became 2**53, silently).

`documents` (the body's, or a kwarg of that name) are counted on a budget of their own,
MAX_DOCUMENT_FIELDS, as the decoder counts them: in the kwargs' 256 fields, a RAG body's 128 documents of
{title, text} were refused. The body's are refused naming `documents...`, as the body names them.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.field_path import child_path
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.body_limits import (
    LIST_LEVELS,
    MAX_DOCUMENT_FIELDS,
    MAX_TEMPLATE_FIELDS,
    MAX_TEMPLATE_LEVELS,
    OBJECT_LEVELS,
)
from tandem.gateway.fields import field

FIELD = "chat_template_kwargs"
MAX_EXACT_INTEGER = 2**53  # doubles hold every integer up to it exactly (the decoder's the same)
TOO_DEEP = (
    f"nests deeper than the decoder's protobuf parser reads (each object counts {OBJECT_LEVELS} of its "
    f"{MAX_TEMPLATE_LEVELS} levels, each list {LIST_LEVELS}: {MAX_TEMPLATE_LEVELS // OBJECT_LEVELS} objects, "
    f"or an object and {(MAX_TEMPLATE_LEVELS - OBJECT_LEVELS) // LIST_LEVELS} lists)"
)


def template_kwargs(
    kwargs: dict[str, Any] | None, chat: decoder_pb2.ChatPrompt, documents: list[Any] | None = None
) -> None:
    """`kwargs` as `chat.template_kwargs`, merged as vLLM merges them over the body's
    add_generation_prompt and `documents` (set on `chat` already, and the body's own), or
    InvalidArgument naming the field and the limit it passes."""
    # vLLM's _preprocess_chat: dict(add_generation_prompt=..., documents=..., ...).update(kwargs), so a
    # kwarg overrides the body's field of its name. A document is an object (vLLM's dict[str, str]).
    documents_field = f"{FIELD}.documents"  # a kwarg's, unless the body's are merged in below
    if documents is not None:
        for i, document in enumerate(documents):
            if not isinstance(document, dict):
                raise InvalidArgument(f"documents[{i}]", f"must be an object, got {type(document).__name__}")
        if kwargs is None or "documents" not in kwargs:  # the body's, named as the body names them
            kwargs, documents_field = {"documents": documents} | (kwargs or {}), "documents"
    if kwargs is None:
        return
    if "add_generation_prompt" in kwargs:  # the chat's own field, never a kwarg the decoder sees
        value = field(kwargs, "add_generation_prompt", bool, f"{FIELD}.")
        chat.add_generation_prompt = bool(value)  # vLLM's null as the template reads it: falsy
        kwargs = {key: value for key, value in kwargs.items() if key != "add_generation_prompt"}
    _check_size(kwargs, documents_field)
    # vLLM merges the kwargs over its own chat_template, tools and continue_final_message, so a template
    # reads these keys as those: each is refused here as the body's own field is.
    if kwargs.get("chat_template") is not None:
        raise InvalidArgument(f"{FIELD}.chat_template", "a request's own chat template is not accepted")
    if field(kwargs, "tools", list, f"{FIELD}."):  # [] asks for no tool, as the body's tools: []
        raise InvalidArgument(f"{FIELD}.tools", "tool calling is not supported")
    if field(kwargs, "continue_final_message", bool, f"{FIELD}."):
        raise InvalidArgument(f"{FIELD}.continue_final_message", "is not supported")
    others = {key: value for key, value in kwargs.items() if key != "documents"}
    for name, value in ((documents_field, kwargs.get("documents")), (FIELD, others)):
        try:
            json.dumps(value, allow_nan=False)  # NaN and the infinities: no JSON, as the decoder reads it
        except (
            UnicodeEncodeError
        ):  # a lone surrogate, a ValueError too: refused as the body's (bodies.convert)
            raise
        except ValueError:
            raise InvalidArgument(name, "must hold finite numbers a double holds") from None
    chat.template_kwargs.update(kwargs)


def _check_size(kwargs: dict[str, Any], documents_field: str) -> None:
    """Counts the values of `kwargs` at every depth, and the objects and lists they nest, stopping at
    the first past its limit: at most MAX_TEMPLATE_FIELDS + MAX_DOCUMENT_FIELDS + 2 values are read
    whatever the width. The `documents` key is one of the kwargs' fields, what it holds counted against
    MAX_DOCUMENT_FIELDS and refused naming `documents_field`. An integer past MAX_EXACT_INTEGER is
    refused on the way, naming its path."""
    documents = kwargs.get("documents")
    if not isinstance(documents, (dict, list)):
        _check_fields(kwargs, FIELD, OBJECT_LEVELS, FIELD, MAX_TEMPLATE_FIELDS)
        return
    # The key is one of the kwargs' fields; what it holds is counted on the documents' budget.
    _check_fields(kwargs | {"documents": None}, FIELD, OBJECT_LEVELS, FIELD, MAX_TEMPLATE_FIELDS)
    levels = OBJECT_LEVELS + (OBJECT_LEVELS if isinstance(documents, dict) else LIST_LEVELS)
    _check_fields(documents, documents_field, levels, documents_field, MAX_DOCUMENT_FIELDS)


def _check_fields(value: dict[str, Any] | list[Any], path: str, levels: int, name: str, limit: int) -> None:
    """Counts the values in `value` (at `path`, `levels` of the parser's deep) at every depth, refusing
    past `limit` of them or past the parser's levels naming `name`."""
    num_fields = 0
    pending: list[tuple[dict[str, Any] | list[Any], str, int]] = [(value, path, levels)]
    while pending:
        container, path, levels = pending.pop()  # the parser's levels down to this one, it included
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            num_fields += 1
            if num_fields > limit:
                raise InvalidArgument(
                    name, f"holds more than the limit of {limit} fields, nested ones included"
                )
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER:
                raise InvalidArgument(
                    child_path(path, key),
                    f"is an integer past ±2^53 ({MAX_EXACT_INTEGER}), the most a double holds exactly",
                )
            if isinstance(value, (dict, list)):
                below = levels + (OBJECT_LEVELS if isinstance(value, dict) else LIST_LEVELS)
                if below > MAX_TEMPLATE_LEVELS:
                    raise InvalidArgument(name, TOO_DEEP)
                pending.append((value, child_path(path, key), below))
