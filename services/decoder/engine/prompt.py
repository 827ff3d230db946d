"""A generation as the engine takes it, and its prompt validated and flattened into a Request.

The servicer converts protos into a GenerateSpec (conversion only); `build_request` checks every
request rule against the model, once, with errors that name the request field, tokenizes text, casts
embedding rows to the model dtype and digests them for prefix caching. The gRPC and the in-process
fronts therefore reject exactly the same requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import tokenizers
import torch

from common import tensors, text_bounds
from common.errors import FailedPrecondition, InvalidArgument
from common.wire_limits import MAX_REQUEST_ID_BYTES
from services.decoder.config import MAX_SPECULATIVE_TOKENS
from services.decoder.engine.chat import ROLES as CHAT_ROLES
from services.decoder.engine.chat import (
    ChatRequest,
    ChatTemplate,
    EmbeddingsPart,
    TextPart,
    TokenIdsPart,
    plain_tokenizer,
)
from services.decoder.engine.outputs import OutputOptions
from services.decoder.engine.params import SamplingParams, StoppingParams
from services.decoder.engine.request import EmbeddingSegment, Request, TokenSegment
from services.decoder.models.config import ModelConfig


@dataclass(frozen=True)
class TextPrompt:
    text: str  # tokenized on arrival, without adding BOS/EOS
    # True: special-token literals ("<|im_start|>") stay plain text; False: they are control tokens.
    is_plain: bool = False


@dataclass(frozen=True)
class EmbeddingPrompt:
    rows: torch.Tensor  # [n, hidden_size], any float dtype; build_request casts it to the model dtype


# A sequence of ints is token IDs: a list, or the proto's repeated field as it is (copying 16M IDs
# into a list costs seconds and gigabytes before the length rule could refuse them).
PromptPart = Sequence[int] | TextPrompt | EmbeddingPrompt


@dataclass(frozen=True)
class GenerateSpec:
    """One generation as the engine takes it (the servicer converts protos into this)."""

    prompt: Sequence[PromptPart]  # empty when `chat` is set
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    output: OutputOptions = field(default_factory=OutputOptions)
    request_id: str = ""  # the caller's label, echoed in events; "" = a random one is assigned
    deadline: float | None = None  # time.monotonic() by which the first step must have started
    cap_max_new_tokens: bool = False  # max_new_tokens was a default: shrink it to fit the context
    chat: ChatRequest | None = None  # a conversation for the model's chat template, instead of `prompt`
    # Most tokens a decode step may propose and verify (prompt lookup), 0-16; None = the engine's.
    speculative_tokens: int | None = None


def build_request(
    spec: GenerateSpec,
    request_id: str,
    tokenizer: tokenizers.Tokenizer,
    model_config: ModelConfig,
    max_model_len: int,
    enable_prompt_embeds: bool,
    chat_template: ChatTemplate | None = None,
    *,
    max_token_chars: int,  # the most characters one token stands for (common/text_bounds.py)
    default_speculative_tokens: int = 0,  # for a spec that leaves speculative_tokens unset
) -> Request:
    """Validate the spec against the model and flatten its prompt into positions.

    NOTE: every request rule is checked here, once, cheapest first: the request id and the sampling
    and stopping values; each segment's emptiness, whether embeddings are accepted, and their shape;
    a bound on the length from sizes alone (token ids and rows counted, text at most one position
    per `max_token_chars` characters), so a prompt that cannot fit costs nothing per position;
    then what reads every position (token ids against the vocabulary, tokenizing text) and the
    context length; only then the embedding rows, cast to the model dtype (the one cast), checked
    finite in it and digested for prefix caching. An empty prompt is Request's own rule. Errors name
    the request field: InvalidArgument, or FailedPrecondition when embeddings are off.
    """
    if len(spec.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes")
    vocab = model_config.vocab_size
    spec.sampling.validate(vocab)
    spec.stopping.validate(vocab)
    speculative_tokens = default_speculative_tokens
    if spec.speculative_tokens is not None:
        if not 0 <= spec.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(
                "speculative_tokens",
                f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {spec.speculative_tokens}",
            )
        speculative_tokens = spec.speculative_tokens
    for i, part in enumerate(spec.prompt):
        _check_segment(i, part, model_config.hidden_size, enable_prompt_embeds)
    if spec.chat is not None:
        if spec.prompt:
            raise InvalidArgument("prompt", "set either prompt or chat, not both")
        _check_chat(spec.chat, model_config.hidden_size, vocab, enable_prompt_embeds)
        if chat_template is None:
            raise FailedPrecondition("chat", "this model has no chat template; send `prompt` segments")
        parts = [_as_prompt_part(part) for message in spec.chat.messages for part in message.content]
        _check_length_bound(parts, max_token_chars, max_model_len, "chat")
        # Chat parts were checked above with their own field paths; what rendering adds is the
        # template's own text, tokenized into this vocabulary.
        rendered = chat_template.tokenize(chat_template.render(spec.chat))
        prompt: Sequence[PromptPart] = [p if isinstance(p, list) else EmbeddingPrompt(p) for p in rendered]
        field_name = "chat"
    else:
        _check_length_bound(spec.prompt, max_token_chars, max_model_len)
        prompt, field_name = spec.prompt, "prompt"
    plain = chat_template.plain_tokenizer if chat_template is not None else None
    positions = [_positions(i, part, tokenizer, plain, vocab) for i, part in enumerate(prompt)]
    num_positions = sum(len(p) if isinstance(p, list) else p.shape[0] for p in positions)
    stopping = _fit_context(spec, num_positions, max_model_len, field_name)
    segments = [
        TokenSegment(p) if isinstance(p, list) else _embedding_segment(i, p, model_config.dtype)
        for i, p in enumerate(positions)
    ]
    request = Request.from_segments(request_id, segments, spec.sampling, stopping, time.monotonic())
    request.num_speculative_tokens = speculative_tokens
    return request


def _check_segment(i: int, part: PromptPart, hidden_size: int, enable_prompt_embeds: bool) -> None:
    """The rules of one segment that cost nothing per position."""
    if isinstance(part, TextPrompt):
        if not part.text:
            raise InvalidArgument(f"prompt[{i}].text", "must not be empty")
    elif isinstance(part, EmbeddingPrompt):
        if not enable_prompt_embeds:
            raise FailedPrecondition(
                f"prompt[{i}].embeddings", "prompt embeddings are disabled on this server"
            )
        rows = part.rows
        if rows.dim() != 2 or rows.shape[1] != hidden_size or rows.shape[0] < 1:
            raise InvalidArgument(
                f"prompt[{i}].embeddings.shape", f"expected [n >= 1, {hidden_size}], got {list(rows.shape)}"
            )
    elif not part:
        raise InvalidArgument(f"prompt[{i}].token_ids.ids", "must not be empty")


def _as_prompt_part(part: TextPart | TokenIdsPart | EmbeddingsPart) -> PromptPart:
    if isinstance(part, TextPart):
        return TextPrompt(part.text, is_plain=True)
    return part.ids if isinstance(part, TokenIdsPart) else EmbeddingPrompt(part.rows)


def _check_length_bound(
    prompt: Sequence[PromptPart], max_token_chars: int, max_model_len: int, field_name: str = "prompt"
) -> None:
    """Refuse a prompt that cannot fit from its sizes alone, before any text is tokenized."""
    num_at_least = sum(
        text_bounds.min_positions(part.text, max_token_chars)
        if isinstance(part, TextPrompt)
        else part.rows.shape[0]
        if isinstance(part, EmbeddingPrompt)
        else len(part)
        for part in prompt
    )
    if num_at_least >= max_model_len:
        raise InvalidArgument(
            field_name,
            f"at least {num_at_least} positions (text takes one per {max_token_chars} characters or "
            f"fewer) leave no room to generate within max_model_len {max_model_len}",
        )


def _positions(
    i: int,
    part: PromptPart,
    tokenizer: tokenizers.Tokenizer,
    plain: tokenizers.Tokenizer | None,
    vocab_size: int,
) -> list[int] | torch.Tensor:
    """A segment's token ids (text tokenized, ids checked against the vocabulary), or its rows as given.

    `plain` is the tokenizer's copy that splits special-token literals into text (built once per
    engine, with its chat template); None builds one here, for callers that passed none.
    """
    if isinstance(part, TextPrompt):
        if part.is_plain:
            tokenizer = plain if plain is not None else plain_tokenizer(tokenizer)
        # encode_batch releases the GIL while it works (encode holds it): the event loop and the
        # engine thread run on while a long text tokenizes on the request-building thread.
        return tokenizer.encode_batch([part.text], add_special_tokens=False)[0].ids
    if isinstance(part, EmbeddingPrompt):
        return part.rows
    for j, token_id in enumerate(part):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(
                f"prompt[{i}].token_ids.ids[{j}]", f"token id {token_id} outside [0, {vocab_size})"
            )
    return list(part)


def _check_chat(chat: ChatRequest, hidden_size: int, vocab_size: int, enable_prompt_embeds: bool) -> None:
    """The chat rules, named by field path: roles, non-empty parts, embeddings on and well shaped, IDs in
    the vocabulary, embedding values finite."""
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must have at least one message")
    for i, message in enumerate(chat.messages):
        path = f"chat.messages[{i}]"
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"{path}.role", f"{message.role[:32]!r} is not one of {', '.join(CHAT_ROLES)}"
            )
        if not message.content:
            raise InvalidArgument(f"{path}.content", "must have at least one part")
        for j, part in enumerate(message.content):
            _check_chat_part(f"{path}.content[{j}]", part, hidden_size, vocab_size, enable_prompt_embeds)


def _check_chat_part(
    path: str, part: TextPart | TokenIdsPart | EmbeddingsPart, hidden: int, vocab: int, embeds_on: bool
) -> None:
    if isinstance(part, TextPart):
        if not part.text:
            raise InvalidArgument(f"{path}.text", "must not be empty")
    elif isinstance(part, TokenIdsPart):
        if not part.ids:
            raise InvalidArgument(f"{path}.token_ids.ids", "must not be empty")
        for k, token_id in enumerate(part.ids):
            if not 0 <= token_id < vocab:
                raise InvalidArgument(
                    f"{path}.token_ids.ids[{k}]", f"token id {token_id} outside [0, {vocab})"
                )
    else:
        if not embeds_on:
            raise FailedPrecondition(f"{path}.embeddings", "prompt embeddings are disabled on this server")
        rows = part.rows
        if rows.dim() != 2 or rows.shape[1] != hidden or rows.shape[0] < 1:
            raise InvalidArgument(
                f"{path}.embeddings.shape", f"expected [n >= 1, {hidden}], got {list(rows.shape)}"
            )
        tensors.require_finite(rows, f"{path}.embeddings")


def _fit_context(
    spec: GenerateSpec, num_positions: int, max_model_len: int, field_name: str = "prompt"
) -> StoppingParams:
    """The stopping params, max_new_tokens shrunk to the context when it was a default; else checked."""
    if num_positions >= max_model_len:
        raise InvalidArgument(
            field_name,
            f"{num_positions} positions leave no room to generate within max_model_len {max_model_len}",
        )
    stopping = spec.stopping
    if spec.cap_max_new_tokens and num_positions + stopping.max_new_tokens > max_model_len:
        return dataclasses.replace(
            stopping,
            max_new_tokens=max_model_len - num_positions,
            min_new_tokens=min(stopping.min_new_tokens, max_model_len - num_positions),
        )
    if num_positions + stopping.max_new_tokens > max_model_len:
        raise InvalidArgument(
            "stopping.max_new_tokens",
            f"prompt ({num_positions}) + max_new_tokens ({stopping.max_new_tokens}) exceeds "
            f"max_model_len {max_model_len}",
        )
    return stopping


def _embedding_segment(i: int, rows: torch.Tensor, dtype: torch.dtype) -> EmbeddingSegment:
    # The one cast to the model dtype, then the checks on what the model will see: a value finite on
    # the wire can overflow to inf in it (float32 3.4e38 in bf16, anything past 65,504 in fp16), and
    # its NaN keys and values would reach the KV cache. The digest then keys those exact rows.
    rows = rows.to(dtype)
    tensors.require_finite(rows, f"prompt[{i}].embeddings")
    return EmbeddingSegment(rows, rows.shape[0], _row_digests(rows))


def _row_digests(rows: torch.Tensor) -> list[bytes]:
    """One digest per embedding row, of its exact bytes, for prefix caching."""
    raw = rows.detach().to("cpu").contiguous()
    raw = raw.view(torch.int16) if raw.dtype.itemsize == 2 else raw
    data = raw.numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in data]
