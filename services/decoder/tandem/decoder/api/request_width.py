"""A GenerateRequest's width, checked from the message's counts before any element is converted.

Conversion (protocol.py) and request building (engine/admission/prompt.py) touch every segment, message, part,
ID and template field; the count checks that follow them came too late for a wide request: 3 million
chat messages (39 MB) kept the event loop converting, and health unanswered, for 14.5 s. Here each
repeated field is only counted (len() of a protobuf container reads no element), against a bound that
follows from the context or from the engine's own limits, so a request past one is refused in
milliseconds, INVALID_ARGUMENT naming the field and the limit:
- every prompt segment and chat part holds at least one position (empty ones are refused later), so
  there are at most max_model_len of them, and of messages (each renders at least its turn's markers);
- token IDs, summed over the request, are positions too;
- stop strings, stop token IDs and logit-bias entries: the engine's own limits (engine/params.py),
  each stop string's length too: the request's span records them, and 16 stop strings of 1 MB, refused
  only by the engine, had made a 16 MB span that lost its neighbours' spans at the collector;
- a caller's chat template and its template_kwargs: MAX_TEMPLATE_CHARS and MAX_TEMPLATE_FIELDS, their
  documents MAX_DOCUMENT_FIELDS.
Everything the engine checks still is; these bounds are only the ones that must come first.
"""

from __future__ import annotations

from google.protobuf import struct_pb2

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.common.wire_limits import MAX_TEMPLATE_CHARS
from tandem.decoder.engine.params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

# Fields of template_kwargs, nested ones included: templates read a handful of flags.
MAX_TEMPLATE_FIELDS = 256
# Fields in its `documents` (an OpenAI body's, which RAG templates read), nested ones included, apart
# from the 256 (its key is one of them): 128 documents of {title, text} were refused at 256, and vLLM
# takes them. 1,000 such documents fit.
MAX_DOCUMENT_FIELDS = 4096


def check_width(request: decoder_pb2.GenerateRequest, max_positions: int) -> None:
    """Raises InvalidArgument for the first count of `request` past its bound."""
    context = f"max_model_len {max_positions}"
    _at_most(
        "prompt", len(request.prompt), max_positions, f"segments ({context}; each is at least one position)"
    )
    positions = sum(_positions(segment, "segment") for segment in request.prompt)
    if request.HasField("chat"):
        chat = request.chat
        _at_most("chat.messages", len(chat.messages), max_positions, f"messages ({context})")
        parts = sum(len(message.content) for message in chat.messages)
        _at_most(
            "chat.messages",
            parts,
            max_positions,
            f"content parts in all ({context}; each is at least one position)",
        )
        positions += sum(_positions(part, "part") for message in chat.messages for part in message.content)
        if chat.HasField("chat_template"):
            _at_most("chat.chat_template", len(chat.chat_template), MAX_TEMPLATE_CHARS, "characters")
        if chat.HasField("template_kwargs"):
            _check_template_kwargs(chat.template_kwargs)
    _at_most("prompt", positions, max_positions, f"token IDs in all ({context})")
    _at_most("stopping.stop_sequences", len(request.stopping.stop_sequences), MAX_STOP_STRINGS, "strings")
    for i, stop in enumerate(request.stopping.stop_sequences):
        _at_most(f"stopping.stop_sequences[{i}]", len(stop), MAX_STOP_STRING_CHARS, "characters")
    _at_most("stopping.stop_token_ids", len(request.stopping.stop_token_ids), MAX_STOP_TOKEN_IDS, "IDs")
    _at_most("sampling.logit_bias", len(request.sampling.logit_bias), MAX_LOGIT_BIAS, "entries")


def _at_most(field: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidArgument(field, f"{count} exceeds the limit of {limit} {what}")


def _positions(piece: decoder_pb2.PromptSegment | decoder_pb2.ChatContentPart, oneof: str) -> int:
    """The positions a segment's or part's token IDs take. Text is counted from its length later, and
    embedding rows by the tensor decoder, whose shape check must name the tensor's own field."""
    return len(piece.token_ids.ids) if piece.WhichOneof(oneof) == "token_ids" else 0


def _check_template_kwargs(kwargs: struct_pb2.Struct) -> None:
    """Counts the kwargs' fields, and what their `documents` holds on a budget of its own."""
    what = "fields, nested ones included"
    top = min(len(kwargs.fields), MAX_TEMPLATE_FIELDS + 1)  # len() reads no value
    _at_most("chat.template_kwargs", top, MAX_TEMPLATE_FIELDS, what)
    nested = {key: _nested(value) for key, value in kwargs.fields.items()}
    documents = nested.pop("documents", None)
    others = [value for value in nested.values() if value is not None]
    count = _count_fields(others, MAX_TEMPLATE_FIELDS, len(kwargs.fields))
    _at_most("chat.template_kwargs", count, MAX_TEMPLATE_FIELDS, what)
    if documents is not None:
        _at_most(
            "chat.template_kwargs.documents",
            _count_fields([documents], MAX_DOCUMENT_FIELDS),
            MAX_DOCUMENT_FIELDS,
            what,
        )


def _nested(value: struct_pb2.Value) -> struct_pb2.Struct | struct_pb2.ListValue | None:
    """The struct or list `value` holds; None: a scalar."""
    kind = value.WhichOneof("kind")
    return (
        value.struct_value if kind == "struct_value" else value.list_value if kind == "list_value" else None
    )


def _count_fields(
    containers: list[struct_pb2.Struct | struct_pb2.ListValue], budget: int, count: int = 0
) -> int:
    """`count` and the fields of `containers` and of every struct and list in them, counting no further
    than past `budget`."""
    pending = list(containers)
    while pending and count <= budget:
        item = pending.pop()
        values = item.fields.values() if isinstance(item, struct_pb2.Struct) else item.values
        for value in values:
            count += 1
            if count > budget:
                break
            if (inner := _nested(value)) is not None:
                pending.append(inner)
    return count
