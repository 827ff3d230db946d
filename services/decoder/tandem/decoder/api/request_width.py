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
- a caller's chat template and its template_kwargs: MAX_TEMPLATE_CHARS and MAX_TEMPLATE_FIELDS.
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
            _at_most(
                "chat.template_kwargs",
                _count_fields(chat.template_kwargs, MAX_TEMPLATE_FIELDS),
                MAX_TEMPLATE_FIELDS,
                "fields, nested ones included",
            )
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


def _count_fields(struct: struct_pb2.Struct, budget: int) -> int:
    """Fields of `struct` and of every struct and list in it, counting no further than past `budget`."""
    count, pending = 0, [struct]
    while pending and count <= budget:
        item = pending.pop()
        values = item.fields.values() if isinstance(item, struct_pb2.Struct) else item.values
        for value in values:
            count += 1
            if count > budget:
                break
            kind = value.WhichOneof("kind")
            if kind == "struct_value":
                pending.append(value.struct_value)
            elif kind == "list_value":
                pending.append(value.list_value)
    return count
