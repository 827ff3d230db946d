"""tandem.v1 decoder messages <-> engine types (TGI's from_pb / to_pb): conversion and nothing else.

Every request rule is checked once, by the engine's request building (`engine/admission/prompt.py`), so the
in-process API rejects exactly what the wire rejects. What fails here is only what cannot be
converted: a segment with nothing set, or an embedding tensor whose bytes do not match its dtype and
shape (`tandem.common.torch_part.tensors`). An `encoder` part becomes an EncoderPrompt whose rows are not
fetched yet (`encoder_parts.py` starts the fetch; a decoder without an encoder refuses it). Errors
name the field the way the proto does, e.g. `prompt[2].embeddings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from google.protobuf import json_format

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import EmbeddingPrompt, EncoderPrompt, PromptPart, TextPrompt
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.outputs.outputs import (
    Accepted,
    Delta,
    Event,
    Finished,
    FinishReason,
    OutputOptions,
)
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprob
from tandem.decoder.engine.outputs.token_bytes import TokenBytes
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.sampling.structured import MAX_CHOICES
from tandem.decoder.engine.scheduling.adapters import Adapter

# max_new_tokens with no bound but the context (cap_to_context, unset): the most the wire's uint32 asks,
# which the cap to the context then makes the room the prompt leaves.
NO_BOUND = 2**32 - 1

_REASONS = {
    FinishReason.LENGTH: decoder_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: decoder_pb2.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: decoder_pb2.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.STOP_TOKEN: decoder_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.CONTEXT_LIMIT: decoder_pb2.FINISH_REASON_CONTEXT_LIMIT,
    FinishReason.ABORTED: decoder_pb2.FINISH_REASON_ABORTED,
}


def spec_from_pb(
    request: decoder_pb2.GenerateRequest, limits: tensors.TensorLimits, time_remaining_s: float | None
) -> GenerateSpec:
    """The request as the engine takes it. Fails only where a field cannot be converted at all."""
    stopping, cap = _stopping_from_pb(request.stopping)
    plain = request.plain_text
    return GenerateSpec(
        prompt=[_part_from_pb(s, f"prompt[{i}]", limits, plain) for i, s in enumerate(request.prompt)],
        sampling=_sampling_from_pb(request.sampling, request.output),
        stopping=stopping,
        output=OutputOptions(
            include_text=not request.output.omit_text, stream_interval=max(1, request.output.stream_interval)
        ),
        request_id=request.request_id,
        deadline=None if time_remaining_s is None else time.monotonic() + time_remaining_s,
        cap_max_new_tokens=cap,
        chat=_chat_from_pb(request.chat, limits) if request.HasField("chat") else None,
        speculative_tokens=request.speculative_tokens if request.HasField("speculative_tokens") else None,
        structured=_structured_from_pb(request.structured) if request.HasField("structured") else None,
        adapter=request.adapter,
    )


def _part_from_pb(
    part: decoder_pb2.PromptSegment | decoder_pb2.ChatContentPart,
    field: str,
    limits: tensors.TensorLimits,
    plain_text: bool = False,
) -> PromptPart:
    """A prompt segment or a chat message part (the same three kinds under two oneof names, and a
    chat part's image: rows the template places)."""
    oneof = "segment" if isinstance(part, decoder_pb2.PromptSegment) else "part"
    kind = part.WhichOneof(oneof)
    if kind == "token_ids":
        return part.token_ids.ids  # not copied: request building bounds the length first
    if kind == "text":
        return TextPrompt(part.text, is_plain=plain_text)
    if kind == "embeddings":
        # Wire checks only (dtype, sizes against the byte count and `limits`); zero-copy.
        return EmbeddingPrompt(tensors.decode(part.embeddings, f"{field}.embeddings", limits=limits))
    if kind == "image":
        return EmbeddingPrompt(tensors.decode(part.image, f"{field}.image", limits=limits), is_image=True)
    if kind == "encoder":
        return _encoder_from_pb(part.encoder, f"{field}.encoder")
    raise InvalidArgument(
        field,
        "set one of token_ids, embeddings, text" + (", image" if oneof == "part" else "") + " or encoder",
    )


def _encoder_from_pb(encoder: encoder_pb2.EncoderInput, field: str) -> EncoderPrompt:
    kind = encoder.WhichOneof("input")
    if kind == "text":
        return EncoderPrompt(kind, encoder.text)
    if kind == "token_ids":
        return EncoderPrompt(kind, encoder.token_ids.ids)  # not copied, as a token_ids segment's
    if kind == "image":
        return EncoderPrompt(kind, encoder.image.data)
    raise InvalidArgument(field, "set one of text, token_ids or image")


def _structured_from_pb(structured: decoder_pb2.StructuredOutput) -> StructuredOutput:
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("structured", "set one of json_schema, json_object, regex, choice or grammar")
    if kind == "choice":
        if len(structured.choice.choices) > MAX_CHOICES:  # counted before anything is copied
            raise InvalidArgument("structured.choice", f"at most {MAX_CHOICES} choices")
        return StructuredOutput(kind, tuple(structured.choice.choices))
    if kind == "json_object":
        if not structured.json_object:
            raise InvalidArgument("structured.json_object", "must be true when set")
        return StructuredOutput(kind, "")
    return StructuredOutput(kind, getattr(structured, kind))


def _chat_from_pb(chat: decoder_pb2.ChatPrompt, limits: tensors.TensorLimits) -> ChatRequest:
    messages = [
        ChatMessage(
            message.role,
            [
                _part_from_pb(part, f"chat.messages[{i}].content[{j}]", limits)
                for j, part in enumerate(message.content)
            ],
            name=message.name if message.HasField("name") else None,
        )
        for i, message in enumerate(chat.messages)
    ]
    return ChatRequest(
        messages=messages,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        template=chat.chat_template if chat.HasField("chat_template") else None,
        template_kwargs=json_format.MessageToDict(chat.template_kwargs),
    )


def _sampling_from_pb(s: decoder_pb2.SamplingParams, out: decoder_pb2.OutputOptions) -> SamplingParams:
    default = SamplingParams()
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else default.temperature,
        top_p=s.top_p if s.HasField("top_p") else default.top_p,
        top_k=s.top_k if s.HasField("top_k") else default.top_k,
        min_p=s.min_p if s.HasField("min_p") else default.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        logit_bias=dict(s.logit_bias),
        seed=s.seed if s.HasField("seed") else None,
        logprobs=out.logprobs,
        top_logprobs=out.top_logprobs,
        prompt_logprobs=out.prompt_logprobs if out.HasField("prompt_logprobs") else None,
    )


def _stopping_from_pb(s: decoder_pb2.StoppingCriteria) -> tuple[StoppingParams, bool]:
    """The params, and whether max_new_tokens is capped to the context: left to the default, or
    cap_to_context (then unset is NO_BOUND, which the cap makes the room the prompt leaves)."""
    explicit = s.HasField("max_new_tokens")
    default = NO_BOUND if s.cap_to_context else StoppingParams().max_new_tokens
    return (
        StoppingParams(
            max_new_tokens=s.max_new_tokens if explicit else default,
            min_new_tokens=s.min_new_tokens,
            stop=tuple(s.stop_sequences),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            include_stop_in_output=s.include_stop_in_output,
        ),
        not explicit or s.cap_to_context,
    )


def event_to_pb(event: Event, token_bytes: TokenBytes | None = None) -> decoder_pb2.GenerateResponse:
    """`event`'s wire form; `token_bytes` spells each token of a delta with logprobs (its token_bytes)."""
    if isinstance(event, Delta):
        # Each token's own bytes, only where logprobs were asked for: the table is read, never decoded.
        spell = token_bytes.of if token_bytes is not None else _unspelled
        return decoder_pb2.GenerateResponse(
            request_id=event.request_id,
            delta=decoder_pb2.TokenDelta(
                token_ids=event.token_ids,
                text=event.text,
                logprobs=event.logprobs,
                top_logprobs=[
                    decoder_pb2.TopLogprobs(
                        token_ids=t.token_ids,
                        logprobs=t.logprobs,
                        token_bytes=spell(t.token_ids),
                    )
                    for t in event.top_logprobs
                ],
                prompt_logprobs=[_prompt_logprob_to_pb(entry, spell) for entry in event.prompt_logprobs],
                token_bytes=spell(event.token_ids) if event.logprobs or event.top_logprobs else (),
            ),
        )
    if isinstance(event, Accepted):
        return decoder_pb2.GenerateResponse(
            request_id=event.request_id,
            accepted=decoder_pb2.PromptAccepted(prompt_tokens=event.prompt_tokens),
        )
    if isinstance(event, Finished):
        finished = decoder_pb2.Finished(
            reason=_REASONS[event.reason],
            usage=tensor_pb2.Usage(
                input_tokens=event.prompt_tokens,
                output_tokens=event.output_tokens,
                cached_input_tokens=event.cached_tokens,
            ),
            time_to_first_token_s=event.time_to_first_token_s,
            total_time_s=event.total_time_s,
            queue_time_s=event.queue_time_s,
            proposed_tokens=event.proposed_tokens,
            accepted_tokens=event.accepted_tokens,
        )
        if event.stop_sequence is not None:
            finished.stop_sequence = event.stop_sequence
        if event.stop_token_id is not None:
            finished.stop_token_id = event.stop_token_id
        return decoder_pb2.GenerateResponse(request_id=event.request_id, finished=finished)
    raise TypeError(f"no wire form for {type(event).__name__}")


def _unspelled(token_ids: Sequence[int]) -> list[bytes]:
    """No bytes for any token: the caller has no table (tests, tools)."""
    return []


def _prompt_logprob_to_pb(
    entry: PromptLogprob, spell: Callable[[Sequence[int]], list[bytes]]
) -> decoder_pb2.PromptLogprob:
    """Unset fields mark what a position lacks: a token (an embedding row), a context (position 0).
    Each token is spelled by its own bytes (`spell`), as a delta's are: a caller has no tokenizer."""
    message = decoder_pb2.PromptLogprob()
    if entry.token_id is not None:
        message.token_id = entry.token_id
        if own := spell([entry.token_id]):
            message.token_bytes = own[0]
    if entry.logprob is not None:
        message.logprob = entry.logprob
    if entry.rank is not None:
        message.rank = entry.rank
    if entry.top_token_ids:
        message.top_logprobs.token_ids.extend(entry.top_token_ids)
        message.top_logprobs.logprobs.extend(entry.top_logprobs)
        message.top_logprobs.token_bytes.extend(spell(entry.top_token_ids))
    return message


def adapter_to_pb(adapter: Adapter) -> decoder_pb2.AdapterInfo:
    return decoder_pb2.AdapterInfo(
        name=adapter.name, path=adapter.path, rank=adapter.rank, target_modules=adapter.targets
    )


def dtype_to_pb(dtype: torch.dtype) -> int:
    return tensors.to_wire_dtype(dtype)
