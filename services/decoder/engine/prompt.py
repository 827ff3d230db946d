"""A generation as the engine takes it, and its prompt flattened into a Request.

The servicer converts protos into a GenerateSpec; `build_request` validates it against the model
(vocabulary, hidden size, context) with errors that name the request field, tokenizes text, casts
embedding rows to the model dtype and digests them for prefix caching.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import tokenizers
import torch

from common.errors import FailedPrecondition, InvalidArgument
from services.decoder.engine.outputs import OutputOptions
from services.decoder.engine.params import SamplingParams, StoppingParams
from services.decoder.engine.request import EmbeddingSegment, Request, TokenSegment
from services.decoder.models.config import ModelConfig


@dataclass(frozen=True)
class TextPrompt:
    text: str  # tokenized on arrival, without special tokens


@dataclass(frozen=True)
class EmbeddingPrompt:
    rows: torch.Tensor  # [n, hidden_size], any float dtype; cast to the model dtype when scheduled


PromptPart = list[int] | TextPrompt | EmbeddingPrompt  # a list of ints is token IDs


@dataclass(frozen=True)
class GenerateSpec:
    """One generation as the engine takes it (the servicer converts protos into this)."""

    prompt: Sequence[PromptPart]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    output: OutputOptions = field(default_factory=OutputOptions)
    request_id: str = ""  # "" = assigned
    deadline: float | None = None  # time.monotonic() by which the first step must have started
    cap_max_new_tokens: bool = False  # max_new_tokens was a default: shrink it to fit the context


def build_request(
    spec: GenerateSpec,
    request_id: str,
    tokenizer: tokenizers.Tokenizer,
    model_config: ModelConfig,
    max_model_len: int,
    enable_prompt_embeds: bool,
) -> Request:
    """Flatten the prompt into positions; raises InvalidArgument naming the bad segment."""
    if not spec.prompt:
        raise InvalidArgument("prompt", "must have at least one segment")
    vocab = model_config.vocab_size
    hidden = model_config.hidden_size
    spec.sampling.validate(vocab)
    spec.stopping.validate(vocab)
    segments: list[TokenSegment | EmbeddingSegment] = []
    for i, part in enumerate(spec.prompt):
        if isinstance(part, TextPrompt):
            if not part.text:
                raise InvalidArgument(f"prompt[{i}].text", "must not be empty")
            segments.append(TokenSegment(tokenizer.encode(part.text, add_special_tokens=False).ids))
        elif isinstance(part, EmbeddingPrompt):
            if not enable_prompt_embeds:
                raise FailedPrecondition(
                    f"prompt[{i}].embeddings", "prompt embeddings are disabled on this server"
                )
            rows = part.rows
            if rows.dim() != 2 or rows.shape[1] != hidden or rows.shape[0] < 1:
                raise InvalidArgument(
                    f"prompt[{i}].embeddings.shape",
                    f"expected [n >= 1, {hidden}], got {list(rows.shape)}",
                )
            # Cast once here: the digest then keys what the model will actually see.
            rows = rows.to(model_config.dtype)
            segments.append(EmbeddingSegment(rows, rows.shape[0], _row_digests(rows)))
        else:
            if not part:
                raise InvalidArgument(f"prompt[{i}].token_ids.ids", "must not be empty")
            for j, token_id in enumerate(part):
                if not 0 <= token_id < vocab:
                    raise InvalidArgument(
                        f"prompt[{i}].token_ids.ids[{j}]", f"token id {token_id} outside [0, {vocab})"
                    )
            segments.append(TokenSegment(list(part)))
    num_positions = sum(len(s.ids) if isinstance(s, TokenSegment) else s.num_rows for s in segments)
    if num_positions >= max_model_len:
        raise InvalidArgument(
            "prompt",
            f"{num_positions} positions leave no room to generate within max_model_len {max_model_len}",
        )
    stopping = spec.stopping
    if spec.cap_max_new_tokens and num_positions + stopping.max_new_tokens > max_model_len:
        stopping = dataclasses.replace(
            stopping,
            max_new_tokens=max_model_len - num_positions,
            min_new_tokens=min(stopping.min_new_tokens, max_model_len - num_positions),
        )
    elif num_positions + stopping.max_new_tokens > max_model_len:
        raise InvalidArgument(
            "stopping.max_new_tokens",
            f"prompt ({num_positions}) + max_new_tokens ({stopping.max_new_tokens}) exceeds "
            f"max_model_len {max_model_len}",
        )
    return Request.from_segments(request_id, segments, spec.sampling, stopping, time.monotonic())


def _row_digests(rows: torch.Tensor) -> list[bytes]:
    """One digest per embedding row, of its exact bytes, for prefix caching."""
    raw = rows.detach().to("cpu").contiguous()
    raw = raw.view(torch.int16) if raw.dtype.itemsize == 2 else raw
    data = raw.numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in data]
