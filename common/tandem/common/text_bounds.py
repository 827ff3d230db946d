"""The cheapest bound on how many positions a text can take: one per `max_token_chars` characters.

No token stands for more text than the vocabulary's longest entry, so a text of `n` characters
takes at least `ceil(n / max_token_chars)` positions (a character is at least one byte). A text
that cannot fit the positions left is refused from its length alone, before anything tokenizes it:
tokenizing costs seconds per megabyte and holds the GIL in `Tokenizer.encode`.

For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) every character of a vocabulary entry is one byte
of text; for other tokenizers an entry's UTF-8 length is an upper bound (SentencePiece's "▁" is 3
bytes for one space), so the bound only gets looser. A normalizer that shrinks text (dropping
accents, say) could make a text fit that this rule refuses; the rule is the documented limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tandem.client.errors import InvalidArgument

if TYPE_CHECKING:  # the tokenizer is the caller's: the contract needs no tokenizers wheel to load
    import tokenizers


def max_token_chars(tokenizer: tokenizers.Tokenizer) -> int:
    """The most characters of text one token of `tokenizer` stands for (added tokens included)."""
    entries = tokenizer.get_vocab(with_added_tokens=True)
    decoder = tokenizer.decoder
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    return vocabulary_bound(entries, is_byte_level=_is_byte_level(spec))


def vocabulary_bound(entries: Iterable[str], is_byte_level: bool) -> int:
    """The longest entry in characters of text: its length when each character encodes one byte
    (byte-level BPE), its UTF-8 length otherwise. At least 1."""
    size = len if is_byte_level else (lambda entry: len(entry.encode()))
    return max((size(entry) for entry in entries), default=1) or 1


def min_positions(text: str, max_chars_per_token: int) -> int:
    """Fewest positions `text` can tokenize to (0 only for empty text)."""
    return math.ceil(len(text) / max_chars_per_token)


def text_rule(max_chars_per_token: int) -> str:
    """How `min_positions` counts text, in a refusal's words."""
    return f"text takes one per {max_chars_per_token} characters or fewer"


def check_fits(
    num_at_least: int, max_positions: int, field: str, counted: str, limit: str, hint: str = ""
) -> None:
    """Refuse what cannot fit from its size alone: `num_at_least` positions over `max_positions`.
    Raises InvalidArgument naming `field` and `limit`, the bound in words (e.g. "max_input_tokens
    512"), and `counted`, how the positions were counted (`text_rule` for text); `hint` (if any) says
    what would fit."""
    if num_at_least > max_positions:
        raise InvalidArgument(field, f"at least {num_at_least} positions ({counted}) exceed {limit}{hint}")


def _is_byte_level(decoder: dict[str, Any]) -> bool:
    """Whether the tokenizer's decoder (its JSON form) maps each vocabulary character to one byte."""
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)
