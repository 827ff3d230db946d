"""A GenerateRequest's width is checked from its counts before anything is converted: each bound
follows from the context or the engine's own limits, and the error names the field and the limit."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.decoder.api.request_width import (
    MAX_DOCUMENT_FIELDS,
    MAX_TEMPLATE_CHARS,
    MAX_TEMPLATE_FIELDS,
    check_width,
)
from tandem.decoder.engine.params import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS

CONTEXT = 64
EACH = "each is at least one position"


def _text(text: str = "hi") -> decoder_pb2.PromptSegment:
    return decoder_pb2.PromptSegment(text=text)


def _chat(messages: int = 1, parts: int = 1, **fields: object) -> decoder_pb2.GenerateRequest:
    content = [decoder_pb2.ChatContentPart(text="hi")] * parts
    chat = decoder_pb2.ChatPrompt(messages=[decoder_pb2.ChatMessage(role="user", content=content)] * messages)
    for name, value in fields.items():
        setattr(chat, name, value)
    return decoder_pb2.GenerateRequest(chat=chat)


def _refused(request: decoder_pb2.GenerateRequest) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        check_width(request, CONTEXT)
    return caught.value


def test_requests_within_every_bound_pass() -> None:
    check_width(decoder_pb2.GenerateRequest(prompt=[_text()] * CONTEXT), CONTEXT)
    check_width(_chat(messages=8, parts=8), CONTEXT)
    ids = decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=range(CONTEXT)))
    check_width(decoder_pb2.GenerateRequest(prompt=[ids]), CONTEXT)


def test_segments_past_the_context_are_refused_before_any_is_looked_at() -> None:
    # Segments with nothing set could not be converted: the count is what refuses them.
    error = _refused(decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment()] * (CONTEXT + 1)))
    assert error.field == "prompt"
    assert (
        error.description
        == f"{CONTEXT + 1} exceeds the limit of {CONTEXT} segments (max_model_len {CONTEXT}; {EACH})"
    )


def test_token_ids_count_as_positions_across_segments_and_parts() -> None:
    ids = decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=range(40)))
    error = _refused(decoder_pb2.GenerateRequest(prompt=[ids, ids]))
    assert (error.field, error.description.split(" exceeds")[0]) == ("prompt", "80")
    part = decoder_pb2.ChatContentPart(token_ids=tensor_pb2.TokenIds(ids=range(CONTEXT + 1)))
    request = _chat()
    request.chat.messages[0].content.append(part)
    assert _refused(request).field == "prompt"
    # Embedding rows are the tensor decoder's to check: its errors name the tensor's shape field.
    rows = decoder_pb2.PromptSegment(embeddings=tensor_pb2.Tensor(shape=[1 << 31, 8]))
    check_width(decoder_pb2.GenerateRequest(prompt=[rows]), CONTEXT)


def test_chat_messages_and_their_parts_are_bounded_by_the_context() -> None:
    assert _refused(_chat(messages=CONTEXT + 1)).field == "chat.messages"
    error = _refused(_chat(messages=5, parts=13))
    assert (error.field, error.description) == (
        "chat.messages",
        f"65 exceeds the limit of {CONTEXT} content parts in all (max_model_len {CONTEXT}; {EACH})",
    )


def test_a_callers_template_and_its_kwargs_are_bounded() -> None:
    check_width(_chat(chat_template="x" * MAX_TEMPLATE_CHARS), CONTEXT)
    assert _refused(_chat(chat_template="x" * (MAX_TEMPLATE_CHARS + 1))).field == "chat.chat_template"
    nested = struct_pb2.Struct()
    nested.update({"flags": {f"f{i}": [i, {"deep": i}] for i in range(MAX_TEMPLATE_FIELDS // 4)}})
    request = _chat()
    request.chat.template_kwargs.CopyFrom(nested)
    error = _refused(request)  # the nested fields count: 1 + 64 x (1 + 2 + 1) = 257
    assert (error.field, error.description) == (
        "chat.template_kwargs",
        f"{MAX_TEMPLATE_FIELDS + 1} exceeds the limit of {MAX_TEMPLATE_FIELDS} fields, nested ones included",
    )


def _kwargs(kwargs: dict) -> decoder_pb2.GenerateRequest:
    request = _chat()
    request.chat.template_kwargs.update(kwargs)
    return request


def test_an_openai_bodys_documents_are_counted_on_a_budget_of_their_own() -> None:
    # Counted in the kwargs' 256, 128 RAG documents of {title, text} were refused; vLLM takes them.
    flags = {f"f{i}": i for i in range(MAX_TEMPLATE_FIELDS - 1)}  # the documents' key is the 256th
    rag = [{"title": "t", "text": "x"}] * (MAX_DOCUMENT_FIELDS // 3)
    check_width(_kwargs(flags | {"documents": rag}), CONTEXT)
    error = _refused(_kwargs(flags | {"documents": rag + [{"a": 1, "b": 2}]}))
    assert (error.field, error.description) == (
        "chat.template_kwargs.documents",
        f"{MAX_DOCUMENT_FIELDS + 1} exceeds the limit of {MAX_DOCUMENT_FIELDS} fields, nested ones included",
    )
    assert _refused(_kwargs(flags | {"x": 1, "documents": []})).field == "chat.template_kwargs"


def test_a_huge_struct_is_counted_only_up_to_past_its_bound() -> None:
    request = _chat()
    request.chat.template_kwargs.update({f"k{i}": i for i in range(20_000)})
    error = _refused(request)
    assert error.description.startswith(f"{MAX_TEMPLATE_FIELDS + 1} exceeds")  # stopped counting there


def test_stop_strings_stop_ids_and_logit_bias_use_the_engines_own_limits() -> None:
    request = decoder_pb2.GenerateRequest(prompt=[_text()])
    request.sampling.logit_bias.update({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    assert _refused(request).field == "sampling.logit_bias"
    request = decoder_pb2.GenerateRequest(prompt=[_text()])
    request.stopping.stop_sequences.extend(["s"] * 17)
    assert _refused(request).field == "stopping.stop_sequences"
    request = decoder_pb2.GenerateRequest(prompt=[_text()])
    request.stopping.stop_token_ids.extend([1] * 65)
    assert _refused(request).field == "stopping.stop_token_ids"


def test_a_stop_strings_length_is_checked_before_the_request_is_recorded() -> None:
    request = decoder_pb2.GenerateRequest(prompt=[_text()])
    request.stopping.stop_sequences.extend(["s" * MAX_STOP_STRING_CHARS, "s" * (MAX_STOP_STRING_CHARS + 1)])
    error = _refused(request)
    assert error.field == "stopping.stop_sequences[1]"
    assert f"limit of {MAX_STOP_STRING_CHARS} characters" in error.description
