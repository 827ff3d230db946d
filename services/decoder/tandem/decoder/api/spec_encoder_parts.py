"""A Generate call's encoder parts, each changed in place and named by its field, for `encoder_parts.py`.

Its own module, apart from the fetching: where encoder parts stand in a GenerateSpec (the prompt's
segments and the chat's message contents) and the field each one's errors name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tandem.common.torch_part.prompt_parts import EncoderPrompt, PromptPart
from tandem.decoder.engine.admission.prompt import GenerateSpec


def with_encoder_parts(
    spec: GenerateSpec, change: Callable[[EncoderPrompt, str], EncoderPrompt]
) -> GenerateSpec | None:
    """`spec` with `change(part, field)` in place of each encoder part, in the prompt's order; None
    where it has none."""
    has_any = False

    def changed(part: PromptPart, field: str) -> PromptPart:
        nonlocal has_any
        if not isinstance(part, EncoderPrompt):
            return part
        has_any = True
        return change(part, field)

    prompt = [changed(part, f"prompt[{i}]") for i, part in enumerate(spec.prompt)]
    chat = spec.chat
    if chat is not None:
        messages = [
            dataclasses.replace(
                message,
                content=[
                    changed(part, f"chat.messages[{i}].content[{j}]")
                    for j, part in enumerate(message.content)
                ],
            )
            for i, message in enumerate(chat.messages)
        ]
        chat = dataclasses.replace(chat, messages=messages)
    return dataclasses.replace(spec, prompt=prompt, chat=chat) if has_any else None
