"""How a chat's parts cross its template: caller parts in, placeholders printed, parts put back.

A token-ID or embedding part (or text at risk of forming a special literal) goes into a message's
content as a placeholder `<<tandem-part-NONCE-I-J>>` (chat.ChatTemplate.render writes it), an image
as transformers' `{"type": "image"}` item (message_content). After the render, splice puts each
placeholder's part back in its place, and place_images gives each image placeholder the template
printed the next image's rows; a part dropped or repeated is the template's fault, refused naming
`chat.chat_template`.
"""

from __future__ import annotations

import re

from tandem.client.errors import InvalidArgument
from tandem.common.torch_part.prompt_parts import PromptPart, TextPrompt

# A rendered prompt: each part with the field path its errors name. The template's own text is
# `TextPrompt(text)` at "chat"; a caller's part keeps its path, `chat.messages[i].content[j]`.
LocatedPart = tuple[str, PromptPart]


def message_content(pieces: list[str | None], as_items: bool) -> str | list[dict[str, str]]:
    """A message's content for the template: a string, or (with images, or `as_items`) transformers'
    list of items."""
    if None not in pieces and not as_items:
        return "".join(piece for piece in pieces if piece is not None)
    items: list[dict[str, str]] = []
    for piece in pieces:
        if piece is None:
            items.append({"type": "image"})
        elif items and items[-1]["type"] == "text":
            items[-1]["text"] += piece
        else:
            items.append({"type": "text", "text": piece})
    return items


def place_images(
    parts: list[LocatedPart], images: list[LocatedPart], placeholder: str | None
) -> list[LocatedPart]:
    """Each placeholder the template wrote (in its own text, never in a caller's) takes the next
    image's rows."""
    assert placeholder
    placed: list[LocatedPart] = []
    remaining = iter(images)
    count = 0
    for path, part in parts:
        if path != "chat" or not isinstance(part, TextPrompt) or placeholder not in part.text:
            placed.append((path, part))
            continue
        pieces = part.text.split(placeholder)
        for k, piece in enumerate(pieces):
            if k:
                count += 1
                image = next(remaining, None)
                if image is None:
                    break
                placed.append(image)
            if piece:
                placed.append(("chat", TextPrompt(piece)))
    if count != len(images):
        raise InvalidArgument(
            "chat.chat_template",
            f"the template wrote {count} image placeholders {placeholder!r} for {len(images)} images; "
            "each image part must be placed exactly once",
        )
    return placed


# Any render's placeholder, its nonce group compared to this render's: a pattern built from the nonce,
# fresh each render, missed re's cache and was compiled anew for every chat with a non-text part.
_PART = re.compile(r"<<tandem-part-([0-9a-f]+)-\d+-\d+>>")


def splice(rendered: list[LocatedPart], spliced: dict[str, LocatedPart], nonce: str) -> list[LocatedPart]:
    """Splits the template's text at the placeholders; each must appear exactly once."""
    parts: list[LocatedPart] = []
    seen: set[str] = set()
    for path, part in rendered:
        if path != "chat" or not isinstance(part, TextPrompt):  # a kwarg's plain text
            parts.append((path, part))
            continue
        text, position = part.text, 0
        for match in _PART.finditer(text):
            if match[1] != nonce:  # not this render's: text that merely looks like a placeholder
                continue
            key = match.group(0)
            if key in seen or key not in spliced:
                raise InvalidArgument("chat.chat_template", "the template repeated a non-text message part")
            seen.add(key)
            if match.start() > position:
                parts.append(("chat", TextPrompt(text[position : match.start()])))
            parts.append(spliced[key])
            position = match.end()
        if position < len(text):
            parts.append(("chat", TextPrompt(text[position:])))
    if len(seen) != len(spliced):
        raise InvalidArgument("chat.chat_template", "the template dropped a non-text message part")
    return parts
