"""A generation as the engine takes it, and its prompt validated and flattened into a Request.

The servicer converts protos into a GenerateSpec (conversion only); `build_request` checks every
request rule against the model, once, with errors that name the request field, tokenizes text, casts
embedding rows to the model dtype and digests them for prefix caching. The gRPC and the in-process
fronts therefore reject exactly the same requests. The rules on one piece of prompt are
`tandem.common.torch_part.prompt_parts`'s, shared by `prompt` segments, chat messages and the encoder.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import tokenizers
import torch

from tandem.client.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from tandem.common.model_name import check_adapter_name
from tandem.common.text_bounds import check_fits
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import (
    EmbeddingPrompt,
    EncoderPrompt,
    PromptPart,
    TextPrompt,
    check_part,
    check_rows,
    check_token_ids,
    field_of,
    how_counted,
    num_positions_at_least,
)
from tandem.common.wire_limits import check_request_id
from tandem.decoder.config import MAX_SPECULATIVE_TOKENS
from tandem.decoder.engine.admission.chat import (
    MAX_NAME_CHARS,
    ChatRequest,
    ChatTemplate,
    no_chat_template,
)
from tandem.decoder.engine.admission.chat import ROLES as CHAT_ROLES
from tandem.decoder.engine.admission.chat_placeholders import LocatedPart
from tandem.decoder.engine.admission.prefix_space import PrefixFree
from tandem.decoder.engine.admission.render_variables import check_template_kwargs
from tandem.decoder.engine.admission.special_literals import literal_tokenizer
from tandem.decoder.engine.outputs.outputs import OutputOptions
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.request import EmbeddingSegment, Request, TokenSegment
from tandem.decoder.engine.sampling import structured
from tandem.decoder.engine.sampling.structured import GrammarCompiler
from tandem.decoder.models.config import ModelConfig

# The prompt-part types are tandem.common.torch_part.prompt_parts's; callers of the engine take them
# from here.
__all__ = [
    "EmbeddingPrompt",
    "EncoderPrompt",
    "GenerateSpec",
    "PromptPart",
    "StructuredOutput",
    "TextPrompt",
    "build_request",
    "check_spec",
    "has_encoder_parts",
]


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
    caller: str = ""  # who sent it (api/caller.py): callers share the batch fairly; "" = anonymous
    structured: StructuredOutput | None = None  # a grammar the answer must follow (sampling/structured.py)
    adapter: str = ""  # the LoRA adapter to run with (its name); "" = the base model
    # time.monotonic() when the call arrived (the servicer's receipt, or Engine.stream's), so that
    # queue-time and TTFT metrics count the wait for a request-building thread (a grammar's compile
    # queue: a client's 1.56 s first token read 0.02 s on the server); None = when built.
    arrival_time: float | None = None
    # The most bytes one of its replies may take (the servicer's --max-message-bytes), so that a request
    # whose prompt logprobs cannot fit one is refused before it runs (admission/prompt_logprob_size.py);
    # None: no bound (in process).
    max_reply_bytes: int | None = None


def build_request(
    spec: GenerateSpec,
    request_id: str,
    tokenizer: tokenizers.Tokenizer,
    model_config: ModelConfig,
    max_model_len: int,
    enable_prompt_embeds: bool,
    chat_template: ChatTemplate | None = None,
    *,
    max_token_chars: int,  # the most characters one token stands for (tandem.common.text_bounds)
    default_speculative_tokens: int = 0,  # for a spec that leaves speculative_tokens unset
    grammars: Callable[[], GrammarCompiler] | None = None,  # the engine's, made on first use
) -> Request:
    """Validate the spec against the model and flatten its prompt into positions.

    NOTE: every request rule is checked here, once, cheapest first: the request id and the sampling
    and stopping values; the chat's messages and roles; each part's emptiness, whether embeddings
    are accepted, and their shape; a bound on the length from sizes alone (token ids and rows
    counted, text at most one position per `max_token_chars` characters), so a prompt that cannot
    fit costs nothing per position (these are `check_spec`, which the servicer runs before it asks
    the encoder for anything); then what reads every position (token ids against the
    vocabulary, tokenizing text), then the rows of encoder parts, waited for only now (their fetch
    started with the call, api/encoder_parts.py, and overlaps all of the above) and shaped like
    embeddings, and the context length; only then the embedding rows, cast to the model dtype (the
    one cast), checked finite in it and digested for prefix caching. A chat takes
    the same path as `prompt` segments: its parts are checked where the caller put them, and its
    rendering (the template's text and the caller's parts, each with its field path) is read like
    segments. An empty prompt is Request's own rule. Errors name the request field: InvalidArgument,
    or FailedPrecondition when embeddings are off or the model has no chat template.
    """
    located = check_spec(
        spec,
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.hidden_size,
        max_model_len=max_model_len,
        enable_prompt_embeds=enable_prompt_embeds,
        has_chat_template=chat_template is not None and chat_template.source is not None,
        has_structured=grammars is not None,
        max_token_chars=max_token_chars,
        template_variables=chat_template.special if chat_template is not None else (),
    )
    if spec.chat is not None and chat_template is None:
        raise no_chat_template()
    vocab = model_config.vocab_size
    field_name = "prompt" if spec.chat is None else "chat"
    speculative_tokens = (
        default_speculative_tokens if spec.speculative_tokens is None else spec.speculative_tokens
    )
    if spec.chat is not None:
        assert chat_template is not None
        located = chat_template.render(spec.chat)
    literal = chat_template.literal_tokenizer if chat_template is not None else None
    # Every other part first: the encoder's rows are waited for last, their fetch overlapping the rest.
    positions: list[list[int] | torch.Tensor | None] = [
        None if isinstance(part, EncoderPrompt) else _positions(path, part, tokenizer, literal, vocab)
        for path, part in located
    ]
    if spec.chat is not None and chat_template is not None and chat_template.prefix_free is not None:
        _join_runs(located, positions, chat_template.prefix_free)
    # The rows as they come, each fetch counted at one position until it settles: once those known
    # leave no room, the request ends here, and with its call the fetches still running (a prompt of a
    # thousand pictures had each through the encoder's tower before the context refused it).
    num_known = sum(len(p) if isinstance(p, list) else p.shape[0] for p in positions if p is not None)  # type: ignore[union-attr]
    num_pending = sum(p is None for p in positions)
    for i, (path, part) in enumerate(located):
        if isinstance(part, EncoderPrompt):
            rows = _fetched_rows(field_of(path, "encoder"), part, model_config.hidden_size, spec.deadline)
            positions[i] = rows
            num_known, num_pending = num_known + rows.shape[0], num_pending - 1
            if num_pending and num_known + num_pending >= max_model_len:
                raise InvalidArgument(
                    field_name,
                    f"at least {num_known + num_pending} positions ({num_pending} encoder parts not yet "
                    f"fetched counted at one each) leave no room to generate within max_model_len "
                    f"{max_model_len}",
                )
    num_positions = sum(len(p) if isinstance(p, list) else p.shape[0] for p in positions)  # type: ignore[union-attr]
    stopping = _fit_context(spec, num_positions, max_model_len, field_name)
    segments = [
        TokenSegment(p)
        if isinstance(p, list)
        else _embedding_segment(
            field_of(
                path,
                "encoder" if isinstance(part, EncoderPrompt) else "image" if part.is_image else "embeddings",
            ),
            p,
            model_config.dtype,
        )
        for (path, part), p in zip(located, positions, strict=True)
    ]
    arrival = time.monotonic() if spec.arrival_time is None else spec.arrival_time
    request = Request.from_segments(request_id, segments, spec.sampling, stopping, arrival)
    request.num_speculative_tokens = speculative_tokens
    request.caller = spec.caller
    request.adapter = spec.adapter
    if spec.structured is not None and grammars is not None:  # last: compiling is the dearest rule
        request.constraint = grammars().constraint(spec.structured, caller=spec.caller)
    return request


def check_spec(
    spec: GenerateSpec,
    *,
    vocab_size: int,
    hidden_size: int,
    max_model_len: int,
    enable_prompt_embeds: bool,
    has_chat_template: bool,  # the model's own: a chat bringing none is refused without it
    has_structured: bool,  # structured output is available
    max_token_chars: int,
    template_variables: Collection[str] = (),  # the checkpoint's special token names its template reads
) -> list[LocatedPart]:
    """The rules `build_request` checks before it reads any position, in its order, up to and including
    the bound on the prompt's length from sizes alone; the caller's parts with their field paths.

    All cost nothing per position, so the servicer runs them on the loop before it asks the encoder
    for any part's rows: a call they refuse is refused for its own field (a tensor's shape, a
    temperature) and costs no Embed call, where the length bound alone ran first and such a call was
    either embedded or refused as too long."""
    check_request_id(spec.request_id)
    if spec.adapter:  # which adapters are loaded is the core's to say, at admission
        check_adapter_name(spec.adapter, "adapter")
    spec.sampling.validate(vocab_size)
    spec.stopping.validate(vocab_size)
    if spec.speculative_tokens is not None and not 0 <= spec.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument(
            "speculative_tokens",
            f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {spec.speculative_tokens}",
        )
    if spec.structured is not None:
        structured.check(spec.structured)
        if spec.stopping.ignore_eos:
            raise InvalidArgument(
                "stopping.ignore_eos", "cannot be combined with structured output: the grammar's end is EOS"
            )
        if not has_structured:
            raise FailedPrecondition("structured", "structured output is not available on this server")
    if spec.chat is not None and spec.prompt:
        raise InvalidArgument("prompt", "set either prompt or chat, not both")
    located = _located_parts(spec)
    for path, part in located:
        check_part(part, path, hidden_size, enable_prompt_embeds)
    if spec.chat is not None and spec.chat.template is None and not has_chat_template:
        raise no_chat_template()
    if spec.chat is not None:  # names and size alone: at render it came after an encoder part's Embed call
        check_template_kwargs(spec.chat.template_kwargs, template_variables)
    field_name = "prompt" if spec.chat is None else "chat"
    _check_sizes_fit([part for _, part in located], field_name, max_model_len, max_token_chars)
    return located


def _check_sizes_fit(
    parts: list[PromptPart], field_name: str, max_model_len: int, max_token_chars: int
) -> None:
    num_at_least = num_positions_at_least(parts, max_token_chars)
    if num_at_least < max_model_len:  # how they were counted is put in words only for a refusal
        return
    check_fits(
        num_at_least,
        max_model_len - 1,
        field_name,
        how_counted(parts, max_token_chars),
        f"the {max_model_len - 1} a prompt may take (max_model_len {max_model_len} less one to generate)",
    )


def has_encoder_parts(spec: GenerateSpec) -> bool:
    """Whether building the request waits for an encoder's rows (then not on a thread others share)."""
    parts = spec.prompt if spec.chat is None else [part for m in spec.chat.messages for part in m.content]
    return any(isinstance(part, EncoderPrompt) and part.rows is not None for part in parts)


def _fetched_rows(field: str, part: EncoderPrompt, hidden_size: int, deadline: float | None) -> torch.Tensor:
    """An encoder part's rows, once its fetch settles: [n, hidden_size]. Its errors are the fetch's."""
    assert part.rows is not None  # check_part's
    try:
        rows = part.rows.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        raise DeadlineExceeded(
            f"{field}: the deadline passed while the encoder's rows were fetched"
        ) from None
    except concurrent.futures.CancelledError:
        raise Unavailable(f"{field}: the fetch of the encoder's rows was cancelled") from None
    check_rows(rows, field, hidden_size)
    return rows


def _located_parts(spec: GenerateSpec) -> list[LocatedPart]:
    """The caller's parts, each with its field path; a chat's structure is checked on the way."""
    if spec.chat is None:
        return [(f"prompt[{i}]", part) for i, part in enumerate(spec.prompt)]
    if not spec.chat.messages:
        raise InvalidArgument("chat.messages", "must have at least one message")
    located = []
    for i, message in enumerate(spec.chat.messages):
        path = f"chat.messages[{i}]"
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"{path}.role", f"{message.role[:32]!r} is not one of {', '.join(CHAT_ROLES)}"
            )
        if not message.content:
            raise InvalidArgument(f"{path}.content", "must have at least one part")
        if message.name is not None and len(message.name) > MAX_NAME_CHARS:
            raise InvalidArgument(
                f"{path}.name", f"{len(message.name)} characters exceed the limit of {MAX_NAME_CHARS}"
            )
        # An empty text is a turn with nothing said (a system prompt of "", as OpenAI and vLLM take
        # it): the template still renders the turn; only a prompt segment must say something.
        located.extend(
            (f"{path}.content[{j}]", part)
            for j, part in enumerate(message.content)
            if not (isinstance(part, TextPrompt) and not part.text)
        )
    return located


def _positions(
    path: str,
    part: PromptPart,
    tokenizer: tokenizers.Tokenizer,
    literal: tokenizers.Tokenizer | None,
    vocab_size: int,
) -> list[int] | torch.Tensor:
    """A part's token ids (text tokenized, ids checked against the vocabulary), or its rows as given.

    `literal` is the tokenizer's twin that keeps special-token literals text, for plain text (built
    once per engine, with its chat template); None builds one here, for callers that passed none.
    """
    if isinstance(part, TextPrompt):
        if part.is_plain:
            tokenizer = literal if literal is not None else literal_tokenizer(tokenizer)
        # encode_batch releases the GIL while it works (encode holds it): the event loop and the
        # engine thread run on while a long text tokenizes on the request-building thread.
        return tokenizer.encode_batch([part.text], add_special_tokens=False)[0].ids
    if isinstance(part, EmbeddingPrompt):
        return part.rows
    check_token_ids(part, field_of(path, "token_ids.ids"), vocab_size)
    return list(part)


def _join_runs(
    located: list[LocatedPart], positions: list[list[int] | torch.Tensor | None], twins: PrefixFree
) -> None:
    """A chat's text parts tokenized again where they continue the previous text part's run, without
    the prefix space each gained alone (prefix_space.py): the ids of the text the chat renders."""
    for i in range(1, len(located)):
        (_, before), (_, part) = located[i - 1], located[i]
        previous = positions[i - 1]
        if not (
            isinstance(before, TextPrompt) and isinstance(part, TextPrompt) and isinstance(previous, list)
        ):
            continue
        if part.text and not twins.ends_run(previous, before.is_plain):
            positions[i] = twins.encode_continuing(part.text, part.is_plain)


def _fit_context(
    spec: GenerateSpec, num_positions: int, max_model_len: int, field_name: str = "prompt"
) -> StoppingParams:
    """The stopping params, max_new_tokens shrunk to the context when it was a default; else checked.
    min_new_tokens is never shrunk: one the context cannot hold is refused, capped or not."""
    if num_positions >= max_model_len:
        raise InvalidArgument(
            field_name,
            f"{num_positions} positions leave no room to generate within max_model_len {max_model_len}",
        )
    stopping = spec.stopping
    room = max_model_len - num_positions
    # Where max_new_tokens was given, min_new_tokens <= it (StoppingParams.validate) and its own check
    # below names it. Where it is capped, shrinking min_new_tokens with it answered less than was asked:
    # a chat without max_tokens asking min_tokens 5000 after a 990-token prompt (context 1024) ran 34
    # tokens and ended `length`, where the same body with max_tokens 10 is refused, and vLLM refuses
    # both ("min_tokens must be less than or equal to max_tokens=34").
    if spec.cap_max_new_tokens and stopping.min_new_tokens > room:
        raise InvalidArgument(
            "stopping.min_new_tokens",
            f"must be at most {room}, the room the prompt's {num_positions} positions leave within "
            f"max_model_len {max_model_len}, got {stopping.min_new_tokens}",
        )
    if spec.cap_max_new_tokens and stopping.max_new_tokens > room:
        return dataclasses.replace(stopping, max_new_tokens=room)
    if num_positions + stopping.max_new_tokens > max_model_len:
        raise InvalidArgument(
            "stopping.max_new_tokens",
            f"prompt ({num_positions}) + max_new_tokens ({stopping.max_new_tokens}) exceeds "
            f"max_model_len {max_model_len}",
        )
    return stopping


def _embedding_segment(field: str, rows: torch.Tensor, dtype: torch.dtype) -> EmbeddingSegment:
    # The one cast to the model dtype, then the checks on what the model will see: a value finite on
    # the wire can overflow to inf in it (float32 3.4e38 in bf16, anything past 65,504 in fp16), and
    # its NaN keys and values would reach the KV cache. The digest then keys those exact rows.
    cast = rows.to(dtype)
    tensors.require_finite(cast, field, sent=rows)
    return EmbeddingSegment(cast, cast.shape[0], _row_digests(cast))


def _row_digests(rows: torch.Tensor) -> list[bytes]:
    """One digest per embedding row, of its exact bytes, for prefix caching."""
    raw = rows.detach().to("cpu").contiguous()
    raw = raw.view(torch.int16) if raw.dtype.itemsize == 2 else raw
    data = raw.numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in data]
