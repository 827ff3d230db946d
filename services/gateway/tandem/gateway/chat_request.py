"""POST /v1/chat/completions bodies -> a Generate request with a chat prompt. Every repeated field is
counted (`body_limits.py`) before its first element is converted."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.gateway.body_limits import MAX_IMAGES, BodyLimits, at_most
from tandem.gateway.calls import GenerateCall, ImagePart
from tandem.gateway.fields import field, shown, uint
from tandem.gateway.images import image_file
from tandem.gateway.parameters import common_parameters, generate_call
from tandem.gateway.template_kwargs import template_kwargs
from tandem.gateway.tensors import tensor

ROLES = ("system", "user", "assistant", "tool", "developer")


def _content_parts(
    content: Any, path: str, i: int, images: list[ImagePart]
) -> list[decoder_pb2.ChatContentPart]:
    """A message's content as parts; an image_url part becomes an empty image part, its file added to
    `images` (the encoder's rows take its place once embedded)."""
    if isinstance(content, str):
        return [decoder_pb2.ChatContentPart(text=content)]
    if not isinstance(content, list):
        raise InvalidArgument(path, "must be a string or a list of content parts")
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
            images.append(ImagePart(i, j, image_file(part, f"{where}.image_url")))
            parts.append(decoder_pb2.ChatContentPart(image=tensor_pb2.Tensor()))
        else:
            raise InvalidArgument(
                where,
                f"part type {shown(kind)} is not supported: text, image_url (a data: URL), "
                "tandem_embeddings or tandem_image_embeddings",
            )
    return parts


def chat_request(body: dict[str, Any], limits: BodyLimits) -> GenerateCall:
    """POST /v1/chat/completions -> a Generate request with a chat prompt. Every other rule is checked
    before an image part's file goes to the encoder: images cost calls."""
    messages = field(body, "messages", list)
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
            raise InvalidArgument(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {shown(role)}"
            )
        participant = field(message, "name", str, f"messages[{i}].")  # its `name`, for the template
        # Dropped, the call's answer (a tool turn) kept; of its type whatever its truthiness.
        for name, kind in (("tool_calls", list), ("function_call", dict)):
            if field(message, name, kind, f"messages[{i}]."):
                raise InvalidArgument(f"messages[{i}].{name}", "tool calling is not supported")
        turn = request.chat.messages.add(role="system" if role == "developer" else role, name=participant)
        content = message.get("content")
        # vLLM reads a missing or null content as [] whatever the role, and renders [] as empty text
        # (parse_chat_message_content); the SDK types an assistant's content as a list of parts.
        if content is None or content == []:
            content = ""
        turn.content.extend(_content_parts(content, f"messages[{i}].content", i, images))
    _template_options(body, request.chat)
    names, n = common_parameters(
        body, request, limits, 1, max_tokens=("max_completion_tokens", "max_tokens"), default_max_tokens=None
    )
    top = uint(body, "top_logprobs", 0, 20)  # OpenAI's bound
    if field(body, "logprobs", bool):
        request.output.logprobs = True
        if top:
            request.output.top_logprobs = top
    elif top is not None:  # as OpenAI and vLLM answer it, rather than dropping the field
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    names = dataclasses.replace(
        names,
        image_urls=frozenset((image.message, image.part) for image in images),
        template_extras=tuple(name for name in ("documents", "chat_template_kwargs") if body.get(name)),
        # The body's documents are the decoder's kwarg of that name unless a kwarg of it overrides them.
        documents=body.get("documents") is not None
        and "documents" not in (body.get("chat_template_kwargs") or {}),
    )
    return generate_call(body, (request,), n, False, tuple(images), names)


def _template_options(body: dict[str, Any], chat: decoder_pb2.ChatPrompt) -> None:
    """vLLM's extras on how the chat is rendered, which the decoder has (Qwen3's
    `{"enable_thinking": false}` was dropped: the model thought aloud anyway); those it has not are
    refused rather than answered otherwise."""
    for name in ("echo", "continue_final_message"):  # the last message repeated, or carried on
        if field(body, name, bool):
            raise InvalidArgument(name, "is not supported")
    add_generation_prompt = field(body, "add_generation_prompt", bool)
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    # A caller's template is code the decoder runs (sandboxed, bounded): vLLM refuses one unless its
    # server trusts callers (--trust-request-chat-template, off by default), and so does the gateway.
    if field(body, "chat_template", str) is not None:
        raise InvalidArgument("chat_template", "a request's own chat template is not accepted")
    template_kwargs(field(body, "chat_template_kwargs", dict), chat, field(body, "documents", list))
