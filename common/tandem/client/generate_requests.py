"""A Generate request from plain Python values: prompt segments, chat turns, a structured output, and
the keyword options of `DecoderClient.generate` / `chat` (`client.py`). Invalid values are refused
here, before any call, naming the field as the gateway does."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import InvalidArgument
from .pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2


@dataclass(frozen=True)
class ImageRows:
    """An image's rows from the encoder (`EncoderClient.embed_image`), as a chat message part: the
    model's chat template places them where it puts an image."""

    rows: tensor_pb2.Tensor  # [n, hidden_size], the image's whole span


@dataclass(frozen=True)
class EncoderPart:
    """An input whose rows the decoder fetches from its own encoder (a decoder started with --encoder:
    GetModelInfo.accepts_encoder_parts), so they never pass through the caller. Exactly one field is
    set; in a chat an image is placed by the model's template, as ImageRows are."""

    image: bytes | None = None  # PNG, JPEG, WebP or GIF bytes
    text: str | None = None
    token_ids: Sequence[int] | None = None

    def to_pb(self) -> encoder_pb2.EncoderInput:
        given = [value is not None for value in (self.image, self.text, self.token_ids)]
        if sum(given) != 1:
            raise ValueError("an EncoderPart holds exactly one of image, text or token_ids")
        if self.image is not None:
            return encoder_pb2.EncoderInput(image=encoder_pb2.Image(data=self.image))
        if self.text is not None:
            return encoder_pb2.EncoderInput(text=self.text)
        return encoder_pb2.EncoderInput(token_ids=tensor_pb2.TokenIds(ids=list(self.token_ids or ())))


# text, token IDs, packed embeddings, or an input for the decoder's encoder
Segment = str | Sequence[int] | tensor_pb2.Tensor | EncoderPart
ChatPart = Segment | ImageRows
# {"role": "user", "content": "..." or [parts] (None, absent or [] is empty text), optionally "name": "alice"
ChatTurn = Mapping[str, str | Sequence[ChatPart] | None]


def prompt_segments(parts: Sequence[Segment]) -> list[decoder_pb2.PromptSegment]:
    segments = []
    for part in parts:
        if isinstance(part, str):
            segments.append(decoder_pb2.PromptSegment(text=part))
        elif isinstance(part, tensor_pb2.Tensor):
            segments.append(decoder_pb2.PromptSegment(embeddings=part))
        elif isinstance(part, EncoderPart):
            segments.append(decoder_pb2.PromptSegment(encoder=part.to_pb()))
        else:
            segments.append(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=list(part))))
    return segments


def _turn_parts(content: object, i: int) -> Sequence[ChatPart]:
    """A turn's parts; None (or no content) and [] are one part of empty text. Only a list or tuple is
    parts: `content or []` took False, 0 and {} for empty text, and list() an OpenAI part object not in
    a list for its keys, where the gateway refuses both in these words."""
    if isinstance(content, str):
        return [content]
    if content is None:
        return [""]
    if not isinstance(content, (list, tuple)):
        raise InvalidArgument(
            f"messages[{i}].content",
            f"must be a string or a list of content parts, got {type(content).__name__}",
        )
    return content or [""]


def chat_prompt(
    messages: Sequence[ChatTurn],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    template_kwargs: dict[str, object] | None = None,
) -> decoder_pb2.ChatPrompt:
    """The ChatPrompt message for `messages` ({"role": ..., "content": str or a list of parts, and
    optionally "name": the participant's, which templates that print it read}). A content of [], None or
    none at all is a turn of empty text, as the gateway sends it (vLLM renders them so): the decoder
    refuses a turn of no parts."""
    prompt = decoder_pb2.ChatPrompt(add_generation_prompt=add_generation_prompt)
    for i, message in enumerate(messages):
        parts = _turn_parts(message.get("content"), i)
        turn = prompt.messages.add(role=str(message["role"]))
        if (name := message.get("name")) is not None:
            # Refused as the gateway refuses it: str() sent ["alice"] to the template as "['alice']".
            if not isinstance(name, str):
                raise InvalidArgument(f"messages[{i}].name", f"must be a string, got {type(name).__name__}")
            turn.name = name
        for part in parts:
            if isinstance(part, str):
                turn.content.add(text=part)
            elif isinstance(part, ImageRows):
                turn.content.add(image=part.rows)
            elif isinstance(part, tensor_pb2.Tensor):
                turn.content.add(embeddings=part)
            elif isinstance(part, EncoderPart):
                turn.content.add(encoder=part.to_pb())
            else:
                turn.content.add(token_ids=tensor_pb2.TokenIds(ids=list(part)))
    if chat_template is not None:
        prompt.chat_template = chat_template
    if template_kwargs:
        prompt.template_kwargs.update(template_kwargs)
    return prompt


def structured_output(
    *,
    json_schema: str | Mapping[str, object] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
) -> decoder_pb2.StructuredOutput:
    """A `structured=` value for generate / chat: exactly one of the arguments (a schema may be a dict)."""
    given = [json_schema is not None, json_object, regex is not None, choice is not None, grammar is not None]
    if sum(given) != 1:
        raise ValueError("give exactly one of json_schema, json_object, regex, choice or grammar")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return decoder_pb2.StructuredOutput(json_schema=text)
    if json_object:
        return decoder_pb2.StructuredOutput(json_object=True)
    if regex is not None:
        return decoder_pb2.StructuredOutput(regex=regex)
    if choice is not None:
        return decoder_pb2.StructuredOutput(choice=decoder_pb2.StructuredChoices(choices=list(choice)))
    return decoder_pb2.StructuredOutput(grammar=grammar)


def set_options(
    request: decoder_pb2.GenerateRequest,
    max_new_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    stopping_and_output: dict[str, object],
) -> None:
    """Keyword arguments onto the request: the named ones, then stopping, output or the request's own
    fields (speculative_tokens, plain_text, adapter) by name."""
    if max_new_tokens is not None:
        request.stopping.max_new_tokens = max_new_tokens
    if temperature is not None:
        request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    for key, value in stopping_and_output.items():
        if key == "structured":  # a message field: structured_output() builds it
            request.structured.CopyFrom(value)  # type: ignore[arg-type]
            continue
        target: object = request
        if key in request.stopping.DESCRIPTOR.fields_by_name:
            target = request.stopping
        elif key in request.output.DESCRIPTOR.fields_by_name:
            target = request.output
        field = getattr(target, key)
        if hasattr(field, "extend"):
            field.extend(value)  # type: ignore[arg-type]
        else:
            setattr(target, key, value)
