"""Where a Generate call's encoder parts stand (`spec_encoder_parts.py`): each changed in place, in the
prompt's order, named by the field its errors name, in a prompt's segments or a chat's message contents;
a call without encoder parts is left as it is."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tandem.common.torch_part.prompt_parts import EncoderPrompt, PromptPart, TextPrompt
from tandem.decoder.api.spec_encoder_parts import with_encoder_parts
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec


def _named(seen: list[str]) -> Callable[[EncoderPrompt, str], EncoderPrompt]:
    """A change that records each part's field and marks the part with it."""

    def change(part: EncoderPrompt, field: str) -> EncoderPrompt:
        seen.append(field)
        return dataclasses.replace(part, content=f"{part.content!r} at {field}".encode())

    return change


def test_a_prompts_encoder_parts_are_named_by_their_segment_and_changed_in_place() -> None:
    prompt: list[PromptPart] = [EncoderPrompt("image", b"a"), TextPrompt("and"), EncoderPrompt("text", "b")]
    seen: list[str] = []
    spec = with_encoder_parts(GenerateSpec(prompt=prompt), _named(seen))
    assert seen == ["prompt[0]", "prompt[2]"]
    assert spec is not None and spec.prompt == [
        EncoderPrompt("image", b"b'a' at prompt[0]"),
        TextPrompt("and"),
        EncoderPrompt("text", b"'b' at prompt[2]"),
    ]


def test_a_chats_encoder_parts_are_named_by_their_message_and_place_in_it() -> None:
    chat = ChatRequest(
        [
            ChatMessage("system", [TextPrompt("be brief")]),
            ChatMessage("user", [TextPrompt("look:"), EncoderPrompt("image", b"p")]),
            ChatMessage("user", [EncoderPrompt("image", b"q")]),
        ]
    )
    seen: list[str] = []
    spec = with_encoder_parts(GenerateSpec(prompt=[], chat=chat), _named(seen))
    assert seen == ["chat.messages[1].content[1]", "chat.messages[2].content[0]"]
    assert spec is not None and spec.chat is not None
    assert [message.content for message in spec.chat.messages] == [
        [TextPrompt("be brief")],
        [TextPrompt("look:"), EncoderPrompt("image", b"b'p' at chat.messages[1].content[1]")],
        [EncoderPrompt("image", b"b'q' at chat.messages[2].content[0]")],
    ]
    assert [message.role for message in spec.chat.messages] == ["system", "user", "user"]


def test_a_call_without_encoder_parts_is_none_and_nothing_is_changed() -> None:
    seen: list[str] = []
    chat = ChatRequest([ChatMessage("user", [TextPrompt("hi")])])
    assert with_encoder_parts(GenerateSpec(prompt=[TextPrompt("hi")]), _named(seen)) is None
    assert with_encoder_parts(GenerateSpec(prompt=[], chat=chat), _named(seen)) is None
    assert seen == []
