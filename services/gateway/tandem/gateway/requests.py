"""OpenAI request bodies -> Tandem's gRPC requests. Conversion and the checks only the gateway can make
(JSON types, OpenAI's parameter names); every limit on the content is the services' own, so a prompt
is refused here exactly as over gRPC, with the services' field paths translated back by `errors.py`.

Tandem's extension, in a prompt or a message's content: a part
`{"type": "tandem_embeddings", "embeddings": {"dtype": "bfloat16" | "float16" | "float32",
"shape": [n, hidden], "data": "<base64 of the raw little-endian bytes>"}}` becomes an embeddings part,
checked by the decoder exactly as a gRPC Tensor is (`tandem.common.torch_part.tensors`); nothing is ever
unpickled or `torch.load`ed. `{"type": "tandem_image_embeddings", ...}` is the same rows as an image part
(the encoder's output for an image; the template places it). OpenAI's own image part, `image_url`
with a data: URL, is sent to the encoder first and its rows placed the same way; or, when the decoder
has an encoder of its own, it goes to the decoder as an encoder part, whose rows the decoder fetches.

Every repeated field is counted (`body_limits.py`) before the first element is converted, and each
function returns what its handler needs of the body (`GenerateCall`, `EmbedCall`), so that a large
body can be converted in another process and dropped there.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2
from tandem.common.dtypes import BY_NAME, FLOAT_NAMES
from tandem.gateway.body_limits import (
    MAX_GUIDED_CHOICES,
    MAX_IMAGES,
    MAX_INPUTS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    BodyLimits,
    at_most,
)
from tandem.gateway.errors import BodyNames

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ImagePart:
    """An OpenAI image part of a chat body: its place and the image file its data: URL holds."""

    message: int  # index in `messages`
    part: int  # index in that message's content, the body's and the request's alike
    data: bytes  # the image file, for the encoder


@dataclass(frozen=True)
class GenerateCall:
    """A completion body, converted: a Generate request per prompt and what the answer needs of the body.
    Each prompt is asked `n` times, each choice a Generate call of its own (`choices.py`)."""

    # One per prompt, in the body's order: one for a chat and for a completion of one prompt, several
    # for a completion's batch (a list of strings or of token-ID lists). Image parts hold an empty
    # Tensor until `images` are embedded.
    requests: tuple[decoder_pb2.GenerateRequest, ...]
    n: int  # choices per prompt (the body's `n`)
    is_batch: bool  # the body's prompt was a list of prompts: an error of prompt i names prompt[i]
    images: tuple[ImagePart, ...]  # chat only: the image_url parts, in order
    model: str  # the body's `model` ("" when absent)
    is_stream: bool  # server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    # The body's names for fields the decoder's errors may name: the field that asked for structured
    # output (`response_format`, `guided_regex`, ...) and its spelling of max_tokens.
    names: BodyNames

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n


@dataclass(frozen=True)
class EmbedCall:
    """An embeddings body, converted: one Embed request per input."""

    requests: tuple[encoder_pb2.EmbedRequest, ...]
    model: str
    is_base64: bool  # encoding_format "base64" (else JSON floats)
    is_list: bool = False  # the body's input was a list: an error names input[i], else input

    def input_field(self, i: int, service_field: str) -> str:
        """The body's field for request i's `service_field` (the encoder's: text, token_ids.ids[j],
        image...): input[i] (input[i][j] for an ID), or input alone when the body gave one input."""
        where = f"input[{i}]" if self.is_list else "input"
        if service_field.startswith("token_ids.ids"):
            return where + service_field.removeprefix("token_ids.ids")
        if service_field.startswith("image"):
            return f"{where}.data"
        if service_field == "text" or service_field == "token_ids":
            return where
        return service_field  # the body's own (model): not the input's


def _field(body: dict[str, Any], name: str, types: type | tuple[type, ...], path: str = "") -> Any:
    value = body.get(name)
    if value is not None and (
        not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types)
    ):
        expected = " or ".join(t.__name__ for t in _as_tuple(types))
        raise InvalidArgument(f"{path}{name}", f"must be {expected}, got {type(value).__name__}")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


def _uint(body: dict[str, Any], name: str, low: int = 0, high: int = UINT32) -> int | None:
    """An integer field (never a bool) within [low, high]: the proto's unsigned range at most."""
    value = _field(body, name, int)
    if value is not None and not low <= value <= high:
        raise InvalidArgument(name, f"must be in [{low}, {high}], got {value}")
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    """A finite number (JSON has no NaN or Infinity; Python's parser accepts them, this does not)."""
    value = _field(body, name, (int, float))
    if value is None:
        return None
    try:
        number = float(value)
    except OverflowError:
        raise InvalidArgument(name, "is too large") from None
    if not math.isfinite(number):
        raise InvalidArgument(name, f"must be a finite number, got {value}")
    return number


def _token_ids(value: Any, path: str, max_ids: int) -> list[int] | None:
    """A non-empty list of token IDs (ints in the proto's range, no bools), or None if it is not one.
    Counted against `max_ids` before any element is looked at."""
    if (
        not isinstance(value, list)
        or not value
        or not isinstance(value[0], int)
        or isinstance(value[0], bool)
    ):
        return None
    at_most(path, len(value), max_ids, "token IDs")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    if min(value) < 0 or max(value) > UINT32:
        raise InvalidArgument(path, f"token IDs must be in [0, {UINT32}]")
    return value


def tensor(value: Any, path: str) -> tensor_pb2.Tensor:
    """Tandem's embeddings extension -> a Tensor message (its bytes decoded from base64, nothing else)."""
    if not isinstance(value, dict):
        raise InvalidArgument(path, "must be an object {dtype, shape, data}")
    dtype = value.get("dtype")
    if not isinstance(dtype, str) or dtype not in FLOAT_NAMES:
        raise InvalidArgument(f"{path}.dtype", f"must be one of {', '.join(FLOAT_NAMES)}, got {dtype!r}")
    shape = value.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)
    ):
        raise InvalidArgument(f"{path}.shape", f"must be [n, hidden_size], got {shape!r}")
    data = value.get("data")
    if not isinstance(data, str):
        raise InvalidArgument(f"{path}.data", "must be a base64 string of the raw little-endian bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{path}.data", "is not valid base64") from None
    return tensor_pb2.Tensor(dtype=BY_NAME[dtype].wire, shape=shape, data=raw)


def _image(part: dict[str, Any], where: str) -> bytes:
    """An OpenAI image part's file: `{"type": "image_url", "image_url": {"url": "data:...;base64,..."}}`.
    Only data URLs: the gateway fetches nothing (a URL it would fetch is a server-side request forgery
    waiting to happen)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise InvalidArgument(
            where, "must be a data: URL (data:image/png;base64,...); the gateway fetches no URL"
        )
    header, _, data = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidArgument(where, "must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(where, "is not valid base64") from None


def _content_parts(
    content: Any, path: str, i: int, images: list[ImagePart]
) -> list[decoder_pb2.ChatContentPart]:
    """A message's content as parts; an image_url part becomes an empty image part, its file added to
    `images` (the encoder's rows take its place once embedded)."""
    if isinstance(content, str):
        return [decoder_pb2.ChatContentPart(text=content)]
    if not isinstance(content, list) or not content:
        raise InvalidArgument(path, "must be a string or a non-empty list of content parts")
    parts = []
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(
                    f"{where}.text", f"must be a string, got {type(part.get('text')).__name__}"
                )
            parts.append(decoder_pb2.ChatContentPart(text=part["text"]))
        elif kind == "tandem_embeddings":
            parts.append(
                decoder_pb2.ChatContentPart(embeddings=tensor(part.get("embeddings"), f"{where}.embeddings"))
            )
        elif kind == "tandem_image_embeddings":
            parts.append(
                decoder_pb2.ChatContentPart(image=tensor(part.get("embeddings"), f"{where}.embeddings"))
            )
        elif kind == "image_url":
            if len(images) == MAX_IMAGES:
                raise InvalidArgument("messages", f"at most {MAX_IMAGES} image_url parts per request")
            images.append(ImagePart(i, j, _image(part, f"{where}.image_url")))
            parts.append(decoder_pb2.ChatContentPart(image=tensor_pb2.Tensor()))
        else:
            raise InvalidArgument(
                where,
                f"part type {kind!r} is not supported: text, image_url (a data: URL), tandem_embeddings or "
                "tandem_image_embeddings",
            )
    return parts


def as_encoder_parts(call: GenerateCall) -> None:
    """Each image_url part of `call` as an encoder part of its file, for a decoder that fetches the
    rows from its encoder itself: they never pass through the gateway."""
    for image in call.images:
        part = call.requests[0].chat.messages[image.message].content[image.part]
        part.encoder.CopyFrom(encoder_pb2.EncoderInput(image=encoder_pb2.Image(data=image.data)))


def chat_request(body: dict[str, Any], limits: BodyLimits) -> GenerateCall:
    """POST /v1/chat/completions -> a Generate request with a chat prompt. Every other rule is checked
    before an image part's file goes to the encoder: images cost calls."""
    messages = _field(body, "messages", list)
    if not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    context = f"(the decoder's context of {limits.max_positions} positions)"
    at_most("messages", len(messages), limits.max_positions, f"messages {context}")
    num_parts = sum(
        len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    at_most("messages", num_parts, limits.max_positions, f"content parts in all {context}")
    request = decoder_pb2.GenerateRequest()
    images: list[ImagePart] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{i}]", "must be an object {role, content}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        turn = request.chat.messages.add(role="system" if role == "developer" else role)
        turn.content.extend(_content_parts(message.get("content"), f"messages[{i}].content", i, images))
    names, n = _common(body, request, limits, 1, max_tokens=("max_completion_tokens", "max_tokens"))
    top = _uint(body, "top_logprobs", 0, 20)  # OpenAI's bound
    if _field(body, "logprobs", bool):
        request.output.logprobs = True
        if top:
            request.output.top_logprobs = top
    elif top is not None:  # as OpenAI and vLLM answer it, rather than dropping the field
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    return _call(body, (request,), n, False, tuple(images), names)


def completion_request(body: dict[str, Any], limits: BodyLimits) -> GenerateCall:
    """POST /v1/completions -> a Generate request of prompt segments, or one per prompt of a batch."""
    prompt = body.get("prompt")
    request = decoder_pb2.GenerateRequest(plain_text=True)
    max_ids = limits.max_positions
    context = f"(the decoder's context of {max_ids} positions)"
    batch: list[Any] = []
    if isinstance(prompt, str):
        request.prompt.add(text=prompt)
    elif (ids := _token_ids(prompt, "prompt", max_ids)) is not None:
        request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=ids))
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > 1 and (
            all(isinstance(part, str) for part in prompt) or all(isinstance(part, list) for part in prompt)
        ):
            # OpenAI's and vLLM's meaning of these forms: a batch, one choice per prompt (times n),
            # its length bounded with n (`_common`). Segments of one prompt mix kinds or carry a
            # tandem_embeddings part.
            batch = prompt
        else:
            _segments(prompt, request, max_ids, context)
    else:
        raise InvalidArgument("prompt", "must be a string, a list of token IDs, or a list of parts")
    names, n = _common(body, request, limits, max(len(batch), 1), max_tokens=("max_tokens",))
    logprobs = _uint(body, "logprobs", 0, 20)
    if logprobs is not None:
        request.output.logprobs = True
        request.output.top_logprobs = logprobs
    if _field(body, "echo", bool):
        raise InvalidArgument("echo", "is not supported")
    if _field(body, "suffix", str):  # insertion: not a decoder-only prompt's shape (vLLM refuses it too)
        raise InvalidArgument("suffix", "is not supported")
    prompts = tuple(_batch_request(request, p, f"prompt[{i}]", max_ids) for i, p in enumerate(batch))
    return _call(body, prompts or (request,), n, bool(batch), (), names)


def _segments(prompt: list[Any], request: decoder_pb2.GenerateRequest, max_ids: int, context: str) -> None:
    """A list of segments of one prompt (text as plain text, token IDs, tandem_embeddings parts)."""
    at_most("prompt", len(prompt), max_ids, f"parts {context}")
    num_ids = sum(len(part) for part in prompt if isinstance(part, list))
    at_most("prompt", num_ids, max_ids, f"token IDs in all {context}")
    for j, part in enumerate(prompt):
        where = f"prompt[{j}]"
        if isinstance(part, str):
            request.prompt.add(text=part)
        elif isinstance(part, dict) and part.get("type") == "tandem_embeddings":
            request.prompt.add(embeddings=tensor(part.get("embeddings"), f"{where}.embeddings"))
        elif (ids := _token_ids(part, where, max_ids)) is not None:
            request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=ids))
        else:
            raise InvalidArgument(where, "must be text, a list of token IDs or a tandem_embeddings part")


def _batch_request(
    parameters: decoder_pb2.GenerateRequest, prompt: str | list[Any], where: str, max_ids: int
) -> decoder_pb2.GenerateRequest:
    """The Generate request of one prompt of a batch: `parameters` (no prompt yet) and its one segment."""
    request = decoder_pb2.GenerateRequest()
    request.CopyFrom(parameters)
    if isinstance(prompt, str):
        request.prompt.add(text=prompt)
    elif (ids := _token_ids(prompt, where, max_ids)) is not None:
        request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=ids))
    else:
        raise InvalidArgument(
            where, "must be a non-empty list of token IDs, as the batch's other prompts are"
        )
    return request


def _call(
    body: dict[str, Any],
    prompts: tuple[decoder_pb2.GenerateRequest, ...],
    n: int,
    is_batch: bool,
    images: tuple[ImagePart, ...],
    names: BodyNames,
) -> GenerateCall:
    is_stream = _field(body, "stream", bool) is True
    options = _field(body, "stream_options", dict)
    if options and not is_stream:  # vLLM's rule: the options of a stream only (an empty {} passes)
        raise InvalidArgument("stream_options", "needs stream: true")
    include_usage = _field(options or {}, "include_usage", bool, "stream_options.") is True
    return GenerateCall(
        requests=prompts,
        n=n,
        is_batch=is_batch,
        images=images,
        model=prompts[0].model,
        is_stream=is_stream,
        include_usage=include_usage,
        names=names,
    )


def _common(
    body: dict[str, Any],
    request: decoder_pb2.GenerateRequest,
    limits: BodyLimits,
    num_prompts: int,
    max_tokens: tuple[str, ...],
) -> tuple[BodyNames, int]:
    """The sampling and stopping parameters both endpoints share, and `n` against the bound on a
    request's choices (`num_prompts` x n); returns the body's names for the fields errors may name,
    and n."""
    request.model = _field(body, "model", str) or ""
    n = _uint(body, "n", 1) or 1
    _bound_choices(num_prompts, n, limits.max_choices)
    best_of = _uint(body, "best_of", 1)
    if best_of is not None and best_of < n:
        raise InvalidArgument("best_of", f"must be at least n ({n}), got {best_of}")
    if best_of is not None and best_of != n:
        # Ranking candidates by their likelihood is gone from vLLM V1 as well; best_of = n is plain n.
        raise InvalidArgument("best_of", f"only best_of equal to n ({n}) is supported, got {best_of}")
    max_tokens_field = max_tokens[-1]
    for name in max_tokens:
        value = _uint(body, name, 1)
        if value is not None:
            request.stopping.max_new_tokens = value
            max_tokens_field = name
            break
    for name, target in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
    ):
        value = _number(body, name)
        if value is not None:
            setattr(request.sampling, target, value)
    # vLLM's extra parameters (the openai SDK sends them with extra_body), where Tandem has them.
    top_k = _field(body, "top_k", int)
    if top_k is not None:
        if not -1 <= top_k <= UINT32:
            raise InvalidArgument(
                "top_k", f"must be -1 (off, as vLLM spells it) or in [0, {UINT32}], got {top_k}"
            )
        request.sampling.top_k = max(top_k, 0)
    for name in ("min_p", "repetition_penalty"):
        value = _number(body, name)
        if value is not None:
            setattr(request.sampling, name, value)
    if _field(body, "ignore_eos", bool):
        request.stopping.ignore_eos = True
    min_tokens = _uint(body, "min_tokens")
    if min_tokens is not None:
        request.stopping.min_new_tokens = min_tokens
    seed = _uint(body, "seed", 0, UINT64)
    if seed is not None:
        request.sampling.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
            raise InvalidArgument("stop", f"must be a string or a list of at most {MAX_STOP} strings")
        request.stopping.stop_sequences.extend(stop)
    logit_bias = _field(body, "logit_bias", dict) or {}
    at_most("logit_bias", len(logit_bias), MAX_LOGIT_BIAS, "entries")
    for key, value in logit_bias.items():
        is_id = key.isascii() and key.isdigit() and int(key) <= UINT32
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_id or not is_number or not math.isfinite(value):
            raise InvalidArgument("logit_bias", f"maps token IDs to finite numbers; got {key!r}: {value!r}")
        request.sampling.logit_bias[int(key)] = float(value)
    structured_field = _structured(body, request)
    for name in ("tools", "functions"):
        if body.get(name):
            raise InvalidArgument(name, "tool calling is not supported")
    return BodyNames(structured_field, max_tokens_field), n


def _bound_choices(num_prompts: int, n: int, max_choices: int) -> None:
    """A request's choices, its prompts x n, each a Generate stream, within `max_choices`; the error
    names `n`, or `prompt` where it is the batch that passes the limit."""
    if num_prompts * n <= max_choices:
        return
    bound = (
        f"the limit of {max_choices} choices a request (prompts x n, each a Generate stream: the "
        "gateway's --max-choices, never above its --max-streams-per-caller)"
    )
    if n > max_choices:
        raise InvalidArgument("n", f"{n} choices exceed {bound}")
    asked = (
        f"{num_prompts} prompts" if n == 1 else f"{num_prompts} prompts x n {n} = {num_prompts * n} choices"
    )
    raise InvalidArgument("prompt", f"{asked} exceed {bound}")


def _structured(body: dict[str, Any], request: decoder_pb2.GenerateRequest) -> str | None:
    """OpenAI's `response_format` (json_schema, json_object) and vLLM's `guided_*` extras -> one
    StructuredOutput; two at once is INVALID_ARGUMENT. Returns the body field that set it."""
    chosen: list[tuple[str, decoder_pb2.StructuredOutput]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict | bool):
                raise InvalidArgument("response_format.json_schema.schema", "must be a JSON schema object")
            chosen.append(("response_format", decoder_pb2.StructuredOutput(json_schema=json.dumps(schema))))
        elif kind == "json_object":
            chosen.append(("response_format", decoder_pb2.StructuredOutput(json_object=True)))
        elif kind != "text":
            raise InvalidArgument(
                "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
            )
    guided_json = body.get("guided_json")
    if guided_json is not None:
        if not isinstance(guided_json, dict | str):
            raise InvalidArgument("guided_json", "must be a JSON schema (an object, or its text)")
        text = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
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


def embed_request(body: dict[str, Any], limits: BodyLimits) -> EmbedCall:
    """POST /v1/embeddings -> one Embed call per input (mean-pooled unless `tandem_pooling` is "none")."""
    max_ids = limits.max_positions
    items = body.get("input")
    is_list = not (isinstance(items, str) or _token_ids(items, "input", max_ids) is not None)
    if not is_list:
        items = [items]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input", "must be a string, a list of strings, or token IDs")
    at_most("input", len(items), MAX_INPUTS, "inputs")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidArgument("encoding_format", f"must be float or base64, got {encoding!r}")
    if body.get("dimensions") is not None:
        raise InvalidArgument("dimensions", "is not supported: rows have the decoder's hidden size")
    pooling = body.get("tandem_pooling", "mean")
    if pooling not in ("mean", "none"):
        raise InvalidArgument("tandem_pooling", f"must be mean or none, got {pooling!r}")
    if pooling == "none" and encoding != "base64":
        # Every row as JSON floats is about 20 bytes a value: 64 inputs of rows could make gigabytes.
        raise InvalidArgument("encoding_format", 'must be "base64" with "tandem_pooling": "none"')
    model = _field(body, "model", str) or ""
    requests = []
    for i, item in enumerate(items):
        request = encoder_pb2.EmbedRequest(
            model=model,
            output_dtype=tensor_pb2.DATA_TYPE_FLOAT32,
            pooling=encoder_pb2.POOLING_MEAN if pooling == "mean" else encoder_pb2.POOLING_NONE,
        )
        if isinstance(item, str):
            request.text = item
        elif (ids := _token_ids(item, f"input[{i}]", max_ids)) is not None:
            request.token_ids.ids.extend(ids)
        elif (
            isinstance(item, dict)
            and item.get("type") == "tandem_image"
            and isinstance(item.get("data"), str)
        ):
            try:
                request.image.data = base64.b64decode(item["data"], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgument(f"input[{i}].data", "is not valid base64") from None
        else:
            raise InvalidArgument(f"input[{i}]", "must be a string, token IDs or a tandem_image part")
        requests.append(request)
    return EmbedCall(tuple(requests), model, encoding == "base64", is_list)
