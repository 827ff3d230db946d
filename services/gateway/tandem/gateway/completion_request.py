"""POST /v1/completions bodies -> a Generate request of prompt segments, or one per prompt of a
batch. Every repeated field is counted (`body_limits.py`) before its first element is converted."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.gateway.body_limits import BodyLimits, at_most
from tandem.gateway.calls import GenerateCall
from tandem.gateway.errors import PromptShape
from tandem.gateway.fields import field, token_ids, uint
from tandem.gateway.parameters import common_parameters, generate_call
from tandem.gateway.tensors import tensor

# max_tokens where the body sets none: OpenAI's and vLLM's CompletionRequest default.
DEFAULT_MAX_TOKENS = 16


def completion_request(body: dict[str, Any], limits: BodyLimits) -> GenerateCall:
    """POST /v1/completions -> a Generate request of prompt segments, or one per prompt of a batch."""
    prompt = body.get("prompt")
    request = decoder_pb2.GenerateRequest(plain_text=True)
    max_ids = limits.max_positions
    context = f"(the decoder's context of {max_ids} positions)"
    batch: list[Any] = []
    shape = None  # how the body gave its one prompt (None: a batch): how an error names it
    if isinstance(prompt, str):
        request.prompt.add(text=prompt)
        shape = PromptShape.TEXT
    elif (ids := token_ids(prompt, "prompt", max_ids)) is not None:
        request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=ids))
        shape = PromptShape.TOKEN_IDS
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > 1 and (
            all(isinstance(part, str) for part in prompt) or all(isinstance(part, list) for part in prompt)
        ):
            # OpenAI's and vLLM's meaning of these forms: a batch, one choice per prompt (times n),
            # its length bounded with n (`common_parameters`). Segments of one prompt mix kinds or carry a
            # tandem_embeddings part.
            batch = prompt
        else:
            _segments(prompt, request, max_ids, context)
            shape = PromptShape.SEGMENTS
    else:
        raise InvalidArgument("prompt", "must be a string, a list of token IDs, or a list of parts")
    names, n = common_parameters(
        body,
        request,
        limits,
        max(len(batch), 1),
        max_tokens=("max_tokens",),
        default_max_tokens=DEFAULT_MAX_TOKENS,
    )
    names = dataclasses.replace(names, prompt=shape)
    logprobs = uint(body, "logprobs", 0, 20)
    if logprobs is not None:
        request.output.logprobs = True
        request.output.top_logprobs = logprobs
    if field(body, "echo", bool):
        raise InvalidArgument("echo", "is not supported")
    if field(body, "suffix", str):  # insertion: not a decoder-only prompt's shape (vLLM refuses it too)
        raise InvalidArgument("suffix", "is not supported")
    prompts = tuple(_batch_request(request, p, f"prompt[{i}]", max_ids) for i, p in enumerate(batch))
    return generate_call(body, prompts or (request,), n, bool(batch), (), names)


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
        elif (ids := token_ids(part, where, max_ids)) is not None:
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
    elif (ids := token_ids(prompt, where, max_ids)) is not None:
        request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=ids))
    else:
        raise InvalidArgument(
            where, "must be a non-empty list of token IDs, as the batch's other prompts are"
        )
    return request
