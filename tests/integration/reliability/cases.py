"""The malformed-request table: every case, the status it must get, and the field it must name.

docs/RELIABILITY.md lists the same cases by name (a test keeps the two in step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2

from .harness import ENCODER_MAX_INPUT_TOKENS, MAX_MESSAGE_BYTES, MAX_MODEL_LEN

HIDDEN = 64  # the tiny default model
VOCAB = 1024
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class Case:
    name: str
    method: str  # "Generate", "DecoderTokenize", "Embed", "EncoderTokenize"
    request: Callable[[], object]  # a message, or raw bytes to put on the wire
    code: grpc.StatusCode
    field: str | None  # the BadRequest field violation, when the status carries one


def gen(*segments: decoder_pb2.PromptSegment, **fields: object) -> decoder_pb2.GenerateRequest:
    r = decoder_pb2.GenerateRequest(prompt=list(segments) or [decoder_pb2.PromptSegment(text="hello")])
    for path, value in fields.items():
        message, name = path.split("__")
        target = getattr(r, message)
        if isinstance(value, list | tuple):
            getattr(target, name).extend(value)
        elif isinstance(value, dict):
            getattr(target, name).update(value)
        else:
            setattr(target, name, value)
    return r


def tokens(*ids: int) -> decoder_pb2.PromptSegment:
    return decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=list(ids)))


def embeds(shape: list[int], dtype: int = tensor_pb2.DATA_TYPE_FLOAT32, data: bytes | None = None):
    size = 4 * math.prod(shape) if all(d > 0 for d in shape) else 0
    tensor = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=bytes(size) if data is None else data)
    return decoder_pb2.PromptSegment(embeddings=tensor)


def _filled(value: float) -> bytes:
    return np.full((1, HIDDEN), value, dtype="<f4").tobytes()


def _chat_with_kwargs(kwargs: dict) -> decoder_pb2.GenerateRequest:
    chat = decoder_pb2.ChatPrompt(
        messages=[decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ChatContentPart(text="hi")])]
    )
    chat.template_kwargs.update(kwargs)
    return decoder_pb2.GenerateRequest(chat=chat)


def structured(output: decoder_pb2.StructuredOutput, **fields: object) -> decoder_pb2.GenerateRequest:
    request = gen(**fields)
    request.structured.CopyFrom(output)
    return request


def embed(**fields: object) -> encoder_pb2.EmbedRequest:
    return encoder_pb2.EmbedRequest(**fields)


def embed_ids_wire(n: int) -> bytes:
    """An EmbedRequest of `n` token IDs (each 5), written as wire bytes: no message object of that
    size is ever built on the client side."""
    inner = b"\x0a" + _varint(n) + b"\x05" * n  # TokenIds.ids, packed
    return b"\x22" + _varint(len(inner)) + inner  # EmbedRequest.token_ids (field 4)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


CASES: list[Case] = [
    # -- Generate: the prompt
    Case("no prompt segments", "Generate", lambda: decoder_pb2.GenerateRequest(), INVALID, "prompt"),
    Case(
        "segment with nothing set", "Generate", lambda: gen(decoder_pb2.PromptSegment()), INVALID, "prompt[0]"
    ),
    Case(
        "empty text", "Generate", lambda: gen(decoder_pb2.PromptSegment(text="")), INVALID, "prompt[0].text"
    ),
    Case("empty token list", "Generate", lambda: gen(tokens()), INVALID, "prompt[0].token_ids.ids"),
    Case(
        "token id = vocab size",
        "Generate",
        lambda: gen(tokens(1, VOCAB)),
        INVALID,
        "prompt[0].token_ids.ids[1]",
    ),
    Case(
        "token id 2^32-1", "Generate", lambda: gen(tokens(2**32 - 1)), INVALID, "prompt[0].token_ids.ids[0]"
    ),
    Case(
        "prompt longer than the context",
        "Generate",
        lambda: gen(tokens(*[5] * MAX_MODEL_LEN)),
        INVALID,
        "prompt",
    ),
    Case(
        "giant text (200 KB)",
        "Generate",
        lambda: gen(decoder_pb2.PromptSegment(text="word " * 40_000)),
        INVALID,
        "prompt",
    ),
    Case(
        "request id over 128 bytes",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(
            request_id="x" * 200, prompt=[decoder_pb2.PromptSegment(text="hi")]
        ),
        INVALID,
        "request_id",
    ),
    Case(
        "unknown model name",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(model="gpt-5", prompt=[decoder_pb2.PromptSegment(text="hi")]),
        grpc.StatusCode.NOT_FOUND,
        None,
    ),
    Case(
        "model name of 20 KB",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(
            model="m" * 20_000, prompt=[decoder_pb2.PromptSegment(text="hi")]
        ),
        INVALID,
        "model",
    ),
    Case(
        "unknown model name of 256 bytes",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(model="m" * 256, prompt=[decoder_pb2.PromptSegment(text="hi")]),
        grpc.StatusCode.NOT_FOUND,
        None,
    ),
    # -- Generate: embedding tensors
    Case(
        "embedding width != hidden size",
        "Generate",
        lambda: gen(embeds([2, HIDDEN + 1])),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(
        "embedding of rank 1",
        "Generate",
        lambda: gen(embeds([HIDDEN])),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(
        "embedding of rank 3",
        "Generate",
        lambda: gen(embeds([1, 2, HIDDEN])),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(
        "embedding with a zero dimension",
        "Generate",
        lambda: gen(embeds([0, HIDDEN])),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(
        "embedding with a negative dimension",
        "Generate",
        lambda: gen(embeds([-1, HIDDEN], data=b"")),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(
        "embedding dtype unset",
        "Generate",
        lambda: gen(embeds([1, HIDDEN], dtype=0)),
        INVALID,
        "prompt[0].embeddings.dtype",
    ),
    Case(
        "embedding dtype unknown enum 99",
        "Generate",
        lambda: gen(embeds([1, HIDDEN], dtype=99)),
        INVALID,
        "prompt[0].embeddings.dtype",
    ),
    Case(
        "embedding dtype INT32",
        "Generate",
        lambda: gen(embeds([1, HIDDEN], dtype=tensor_pb2.DATA_TYPE_INT32)),
        INVALID,
        "prompt[0].embeddings.dtype",
    ),
    Case(
        "embedding bytes one short",
        "Generate",
        lambda: gen(embeds([2, HIDDEN], data=bytes(8 * HIDDEN - 1))),
        INVALID,
        "prompt[0].embeddings.data",
    ),
    Case(
        "tiny message declaring a 2^62-element tensor",
        "Generate",
        lambda: gen(embeds([2**31, 2**31], data=b"\0" * 16)),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(  # the whole product took 4.9 s on the event loop, with the square of the count; then INTERNAL
        "embedding shape of 40,000 dimensions of 2^62",
        "Generate",
        lambda: gen(decoder_pb2.PromptSegment(embeddings=tensor_pb2.Tensor(dtype=1, shape=[2**62] * 40_000))),
        INVALID,
        "prompt[0].embeddings.shape",
    ),
    Case(
        "embedding with NaN",
        "Generate",
        lambda: gen(embeds([1, HIDDEN], data=_filled(float("nan")))),
        INVALID,
        "prompt[0].embeddings.data",
    ),
    Case(
        "embedding with +Inf",
        "Generate",
        lambda: gen(embeds([1, HIDDEN], data=_filled(float("inf")))),
        INVALID,
        "prompt[0].embeddings.data",
    ),
    Case(
        "embedding rows longer than the context",
        "Generate",
        lambda: gen(embeds([MAX_MODEL_LEN, HIDDEN])),
        INVALID,
        "prompt",
    ),
    # -- Generate: sampling
    Case(
        "temperature < 0",
        "Generate",
        lambda: gen(sampling__temperature=-0.5),
        INVALID,
        "sampling.temperature",
    ),
    Case(
        "temperature NaN",
        "Generate",
        lambda: gen(sampling__temperature=float("nan")),
        INVALID,
        "sampling.temperature",
    ),
    Case("top_p = 0", "Generate", lambda: gen(sampling__top_p=0.0), INVALID, "sampling.top_p"),
    Case("top_p > 1", "Generate", lambda: gen(sampling__top_p=1.5), INVALID, "sampling.top_p"),
    Case("min_p > 1", "Generate", lambda: gen(sampling__min_p=2.0), INVALID, "sampling.min_p"),
    Case(
        "repetition_penalty = 0",
        "Generate",
        lambda: gen(sampling__repetition_penalty=0.0),
        INVALID,
        "sampling.repetition_penalty",
    ),
    Case(
        "presence_penalty = 5",
        "Generate",
        lambda: gen(sampling__presence_penalty=5.0),
        INVALID,
        "sampling.presence_penalty",
    ),
    Case(
        "frequency_penalty = -5",
        "Generate",
        lambda: gen(sampling__frequency_penalty=-5.0),
        INVALID,
        "sampling.frequency_penalty",
    ),
    Case(
        "logit_bias on a token outside the vocab",
        "Generate",
        lambda: gen(sampling__logit_bias={VOCAB: 1.0}),
        INVALID,
        f"sampling.logit_bias[{VOCAB}]",
    ),
    Case(
        "logit_bias value 1000",
        "Generate",
        lambda: gen(sampling__logit_bias={5: 1000.0}),
        INVALID,
        "sampling.logit_bias[5]",
    ),
    Case(
        "top_logprobs = 99", "Generate", lambda: gen(output__top_logprobs=99), INVALID, "output.top_logprobs"
    ),
    Case(
        "speculative_tokens = 17",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(prompt=gen().prompt, speculative_tokens=17),
        INVALID,
        "speculative_tokens",
    ),
    Case(
        "prompt_logprobs = 21",
        "Generate",
        lambda: gen(output__prompt_logprobs=21),
        INVALID,
        "output.prompt_logprobs",
    ),
    # -- Generate: width, counted before any element is converted (request_width.py). The segments
    # and parts below could not be converted at all: refused for their count, never for their contents.
    Case(
        "more segments than max_model_len",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment()] * (MAX_MODEL_LEN + 1)),
        INVALID,
        "prompt",
    ),
    Case(
        "more token IDs than max_model_len over several segments",
        "Generate",
        lambda: gen(tokens(*range(200)), tokens(*range(100))),
        INVALID,
        "prompt",
    ),
    Case(
        "more chat messages than max_model_len",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(
            chat=decoder_pb2.ChatPrompt(messages=[decoder_pb2.ChatMessage(role="?")] * (MAX_MODEL_LEN + 1))
        ),
        INVALID,
        "chat.messages",
    ),
    Case(
        "more chat parts than max_model_len",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(
            chat=decoder_pb2.ChatPrompt(
                messages=[decoder_pb2.ChatMessage(role="?", content=[decoder_pb2.ChatContentPart()] * 200)]
                * 2
            )
        ),
        INVALID,
        "chat.messages",
    ),
    Case(
        "chat template of 65 KiB",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(
            chat=decoder_pb2.ChatPrompt(
                messages=[
                    decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ChatContentPart(text="hi")])
                ],
                chat_template="x" * (65 * 1024),
            )
        ),
        INVALID,
        "chat.chat_template",
    ),
    Case(
        "chat image part on a text-only model",
        "Generate",
        lambda: decoder_pb2.GenerateRequest(
            chat=decoder_pb2.ChatPrompt(
                messages=[
                    decoder_pb2.ChatMessage(
                        role="user",
                        content=[decoder_pb2.ChatContentPart(image=embeds([2, HIDDEN]).embeddings)],
                    )
                ]
            )
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "chat.messages[0].content[0].image",
    ),
    Case(
        "structured JSON schema that is not JSON",
        "Generate",
        lambda: structured(decoder_pb2.StructuredOutput(json_schema="{oops")),
        INVALID,
        "structured.json_schema",
    ),
    Case(
        "structured JSON schema no finite JSON matches",
        "Generate",
        lambda: structured(
            decoder_pb2.StructuredOutput(
                json_schema='{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'
            )
        ),
        INVALID,
        "structured.json_schema",
    ),
    Case(
        "structured regex that does not compile",
        "Generate",
        lambda: structured(decoder_pb2.StructuredOutput(regex="((")),
        INVALID,
        "structured.regex",
    ),
    Case(
        "structured grammar of 70,000 characters",
        "Generate",
        lambda: structured(decoder_pb2.StructuredOutput(grammar="x" * 70_000)),
        INVALID,
        "structured.grammar",
    ),
    Case(
        "structured output with ignore_eos",
        "Generate",
        lambda: structured(decoder_pb2.StructuredOutput(regex="a"), stopping__ignore_eos=True),
        INVALID,
        "stopping.ignore_eos",
    ),
    Case(
        "template_kwargs of 300 nested fields",
        "Generate",
        lambda: _chat_with_kwargs({"a": {f"k{i}": [i, {"x": i}] for i in range(100)}}),
        INVALID,
        "chat.template_kwargs",
    ),
    Case(
        "1,025 logit_bias entries",
        "Generate",
        lambda: gen(sampling__logit_bias={i: 1.0 for i in range(1025)}),
        INVALID,
        "sampling.logit_bias",
    ),
    # -- Generate: stopping
    Case(
        "max_new_tokens = 0",
        "Generate",
        lambda: gen(stopping__max_new_tokens=0),
        INVALID,
        "stopping.max_new_tokens",
    ),
    Case(
        "prompt + max_new_tokens over the context",
        "Generate",
        lambda: gen(stopping__max_new_tokens=MAX_MODEL_LEN),
        INVALID,
        "stopping.max_new_tokens",
    ),
    Case(
        "min_new_tokens > max_new_tokens",
        "Generate",
        lambda: gen(stopping__max_new_tokens=4, stopping__min_new_tokens=9),
        INVALID,
        "stopping.min_new_tokens",
    ),
    Case(
        "17 stop strings",
        "Generate",
        lambda: gen(stopping__stop_sequences=[f"s{i}" for i in range(17)]),
        INVALID,
        "stopping.stop_sequences",
    ),
    Case(
        "empty stop string",
        "Generate",
        lambda: gen(stopping__stop_sequences=[""]),
        INVALID,
        "stopping.stop_sequences[0]",
    ),
    Case(
        "stop string of 300 characters",
        "Generate",
        lambda: gen(stopping__stop_sequences=["x" * 300]),
        INVALID,
        "stopping.stop_sequences[0]",
    ),
    Case(
        "stop token id outside the vocab",
        "Generate",
        lambda: gen(stopping__stop_token_ids=[VOCAB + 3]),
        INVALID,
        "stopping.stop_token_ids[0]",
    ),
    # -- on the wire
    Case(
        "invalid UTF-8 in a stop string",
        "Generate",
        # GenerateRequest{prompt: [{text: "hi"}], stopping: {stop_sequences: [b"\xff\xfe"]}}
        lambda: b"\x1a\x04\x1a\x02hi" + b"\x2a\x04\x1a\x02\xff\xfe",
        INVALID,
        "stopping.stop_sequences[0]",
    ),
    Case("random bytes", "Generate", lambda: b"\xde\xad\xbe\xef" * 8, INVALID, "request"),
    Case(
        "message over the size limit",
        "Generate",
        lambda: gen(decoder_pb2.PromptSegment(text="a" * (MAX_MESSAGE_BYTES + 10))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        None,
    ),
    Case(
        "Tokenize with 65 texts",
        "DecoderTokenize",
        lambda: decoder_pb2.DecoderTokenizeRequest(texts=["a"] * 65),
        INVALID,
        "texts",
    ),
    # -- Embed
    Case("Embed with no input", "Embed", lambda: embed(), INVALID, "input"),
    Case("Embed empty text", "Embed", lambda: embed(text=""), INVALID, "text"),
    Case(
        "Embed invalid UTF-8 in its text",
        "Embed",
        # EmbedRequest{text: b"\xff\xfe"}: Embed has its own parser (request_size.py)
        lambda: b"\x1a\x02\xff\xfe",
        INVALID,
        "text",
    ),
    Case(
        "Embed empty token list",
        "Embed",
        lambda: embed(token_ids=tensor_pb2.TokenIds()),
        INVALID,
        "token_ids.ids",
    ),
    Case(
        "Embed token id = vocab size",
        "Embed",
        lambda: embed(token_ids=tensor_pb2.TokenIds(ids=[3, VOCAB])),
        INVALID,
        "token_ids.ids[1]",
    ),
    Case(
        "Embed too many tokens",
        "Embed",
        lambda: embed(token_ids=tensor_pb2.TokenIds(ids=[3] * (ENCODER_MAX_INPUT_TOKENS + 1))),
        INVALID,
        "token_ids",
    ),
    Case(
        "Embed output dtype INT32",
        "Embed",
        lambda: embed(text="hi", output_dtype=tensor_pb2.DATA_TYPE_INT32),
        INVALID,
        "output_dtype",
    ),
    Case(
        "Embed output dtype unknown enum 99",
        "Embed",
        lambda: embed(text="hi", output_dtype=99),
        INVALID,
        "output_dtype",
    ),
    Case("Embed pooling unknown enum 99", "Embed", lambda: embed(text="hi", pooling=99), INVALID, "pooling"),
    Case(
        "Embed request id over 128 bytes",
        "Embed",
        lambda: embed(text="hi", request_id="r" * 200),
        INVALID,
        "request_id",
    ),
    Case(
        "Embed unknown model name",
        "Embed",
        lambda: embed(text="hi", model="other"),
        grpc.StatusCode.NOT_FOUND,
        None,
    ),
    Case(
        "Embed model name of 20 KB", "Embed", lambda: embed(text="hi", model="m" * 20_000), INVALID, "model"
    ),
    Case("Embed random bytes", "Embed", lambda: b"\xde\xad\xbe\xef" * 8, INVALID, "request"),
    Case(
        "Embed of 200,000 token IDs, refused from its size unparsed",
        "Embed",
        lambda: embed_ids_wire(200_000),
        INVALID,
        "token_ids",
    ),
    Case(
        "Embed an image on a text-only model",
        "Embed",
        lambda: encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"\x89PNG\r\n\x1a\n")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "image",
    ),
    Case(
        "Encoder Tokenize with 65 texts",
        "EncoderTokenize",
        lambda: encoder_pb2.EncoderTokenizeRequest(texts=["a"] * 65),
        INVALID,
        "texts",
    ),
]
