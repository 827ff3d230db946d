"""Each vocabulary entry's own text as bytes, for logprobs: what OpenAI's `bytes` and `token` are made of.

A delta's `text` is the text of all its tokens together (several when the reader fell behind and
deltas were merged, or a step verified a proposal), and a token may hold part of a character, so no
token's text can be cut out of it. The entry alone is the token's own: byte-level BPE (GPT-2, Llama 3,
Qwen, SmolLM2) spells each byte as one character of its alphabet; SentencePiece spells a space "▁"
and a byte it has no piece for "<0xNN>" (byte fallback); GGUF checkpoints load as one of these two.

NOTE: a table built once, at load, rather than a decode per token. Decoding one token per call costs
a few microseconds of Rust each and loses a partial character's bytes to U+FFFD; reading the table is
an index, on the servicer's thread, only for deltas that carry logprobs (32 rows with top_logprobs 20:
about 80 us more a step than without bytes; nothing without logprobs). Building it reads each entry
once (SmolLM2's 49,152 entries: 80-170 ms on a busy 2-core machine, 2 MB). A decoder this module does
not know (WordPiece's "##", a Replace of a regex, say) falls back to decoding each entry alone, once, at load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import tokenizers

# Decoders whose per-entry effect is a character mapping this module applies itself. Fuse joins tokens
# and Strip trims the start of a whole text: neither changes a token's own bytes. Replace is known only
# with a plain string pattern (`_is_known`): a regex's matches this module does not reproduce.
KNOWN_DECODERS = frozenset({"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenBytes:
    """Token ID -> its text's bytes; an ID past the tokenizer's entries (a padded embedding row) has none."""

    table: tuple[bytes, ...]  # [num_entries] the entry's own bytes, indexed by token ID

    def of(self, token_ids: Sequence[int]) -> list[bytes]:
        """The bytes of each of `token_ids`, in order."""
        table, size = self.table, len(self.table)
        return [table[i] if i < size else b"" for i in token_ids]


def token_bytes_table(tokenizer: tokenizers.Tokenizer) -> TokenBytes:
    """The table of `tokenizer`'s entries, special and added tokens included (their content)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    spec = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
    parts = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec] if spec else []
    if not all(_is_known(part) for part in parts):
        return TokenBytes(
            tuple(tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(size))
        )
    kinds = [part.get("type") for part in parts]
    is_byte_level = "ByteLevel" in kinds
    has_byte_fallback = "ByteFallback" in kinds
    replacements = _replacements(parts)
    # With ByteLevel, a Replace before it changes the entry's characters and one after it the decoded
    # text: each applied on its side (one after it was ignored: Replace("a", "b") left entry "a" b"a").
    split = kinds.index("ByteLevel") if is_byte_level else 0
    before, after = _replacements(parts[:split]), _replacements(parts[split:])
    table = []
    for i in range(size):
        entry = tokenizer.id_to_token(i)
        if entry is None:
            table.append(b"")
        elif is_byte_level:
            for old, new in before:
                entry = entry.replace(old, new)
            own = _byte_level(entry)
            for old, new in after:  # on bytes: UTF-8's characters never match inside another's bytes
                own = own.replace(old.encode(), new.encode())
            table.append(own)
        elif has_byte_fallback and (piece := _BYTE_PIECE.fullmatch(entry)) is not None:
            table.append(bytes([int(piece.group(1), 16)]))
        else:
            for old, new in replacements:
                entry = entry.replace(old, new)
            table.append(entry.encode())
    return TokenBytes(tuple(table))


def _is_known(part: dict[str, Any]) -> bool:
    """Whether this module spells `part`'s effect itself; a Replace of a Regex pattern is not."""
    if part.get("type") == "Replace":
        return "String" in part.get("pattern", {})
    return part.get("type") in KNOWN_DECODERS


def _replacements(parts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (old, new) strings of the decoders' Replace and Metaspace steps, in order."""
    pairs = []
    for part in parts:
        if part.get("type") == "Replace" and "String" in part.get("pattern", {}):
            pairs.append((part["pattern"]["String"], part["content"]))
        elif part.get("type") == "Metaspace":
            pairs.append((part.get("replacement", "▁"), " "))
    return pairs


def _byte_level(entry: str) -> bytes:
    """A byte-level BPE entry's bytes. The tokenizers library's ByteLevel decoder maps an entry back
    only when every character is in the byte alphabet; one with any other character (an added token's
    "łódź": "ł" is outside it, "ó" inside) is kept whole as its own UTF-8, as here."""
    alphabet = _byte_alphabet()
    if all(char in alphabet for char in entry):
        return b"".join(alphabet[char] for char in entry)
    return entry.encode()


@cache
def _byte_alphabet() -> dict[str, bytes]:
    """GPT-2's printable stand-in for each byte -> the byte: printable Latin-1 stands for itself, the
    rest (controls, space, ...) map to U+0100 onward in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = bytes([byte])
        else:
            chars[chr(256 + extra)] = bytes([byte])
            extra += 1
    return chars
