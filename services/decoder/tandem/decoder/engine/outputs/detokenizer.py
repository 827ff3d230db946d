"""Incremental, UTF-8-safe detokenization with stop strings.

NOTE: two offsets into the token ids make decoding incremental (vLLM / TGI): text is emitted as
    decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])
and only when that window's text does not end in U+FFFD, the mark of a character whose bytes are
still split across tokens. Decoding a short window rather than single tokens keeps tokenizers whose
decoders look at neighbours (sentencepiece's leading-space "▁", byte fallback) correct.

Stop strings: the emitted text never holds the start of a stop string that could still complete:
the longest tail of the new text that is a proper prefix of some stop is held back (fewer than
max(len(stop)) characters). The stop that ends first in the text wins, the longest on a tie, so the
output depends on the text alone, never on how tokens split it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

# Prompt tokens decoded before the first output token, so a sentencepiece tokenizer sees the context
# that decides whether the first output token's "▁" becomes a space. Only the token IDs after the
# prompt's last embedding position qualify: an embedding position holds a placeholder ID, and text
# before an embedding does not touch the output.
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerStep:
    """What one `add` or `flush` releases."""

    new_text: str  # safe to emit now; never a partial character nor a possible stop-string start
    matched_stop: str | None  # the stop string that ended the request; new_text stops there
    num_tokens: int  # token ids consumed; fewer than given only when a stop string matched early


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """The stop string in `text` that ends first (the longest on a tie) and where it starts."""
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for s in stop:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), -len(s)) < best[:2]):
            best = (start + len(s), -len(s), s)
    return None if best is None else (best[0] + best[1], best[2])


def prompt_context(prompt_token_ids: Sequence[int], is_token_ids: Sequence[bool]) -> list[int]:
    """The prompt's trailing token IDs (at most NUM_PROMPT_CONTEXT_TOKENS) after its last embedding."""
    if len(is_token_ids) != len(prompt_token_ids):
        raise ValueError(
            f"is_token_ids has {len(is_token_ids)} entries for a prompt of {len(prompt_token_ids)}"
        )
    start = len(prompt_token_ids)
    while start > 0 and len(prompt_token_ids) - start < NUM_PROMPT_CONTEXT_TOKENS and is_token_ids[start - 1]:
        start -= 1
    return list(prompt_token_ids[start:])


def num_held_chars(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a safe chunk at a time."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] | None,  # [prompt_len] context only; prompt text is never emitted
        is_token_ids: Sequence[bool] | None,  # [prompt_len] True = a token ID, False = an embedding row
        stop: Sequence[str],
        include_stop: bool,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        # The prompt context followed by every output id.
        self.token_ids = prompt_context(prompt_token_ids or (), is_token_ids or ())
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)  # ids before it have been turned into text
        self.held_text = ""  # decoded text not emitted yet: it may start a stop string
        self.is_finished = False

    def add(self, token_ids: Sequence[int], match_stops: bool = True) -> DetokenizerStep:
        """Decode newly sampled ids; stops at the first stop string and ignores the ids after it.
        match_stops=False (within min_new_tokens): their text is released whole and never matched, so
        a stop string is looked for only in the text of ids added with match_stops."""
        if self.is_finished:
            raise RuntimeError("add() after the detokenizer finished (stop string or flush)")
        emitted = []
        for i, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            self.held_text += self._decode_new_text()
            if not match_stops:
                emitted.append(self.held_text)
                self.held_text = ""
                continue
            new_text, matched_stop = self._release(final=False)
            emitted.append(new_text)
            if matched_stop is not None:
                return DetokenizerStep("".join(emitted), matched_stop, i + 1)
        return DetokenizerStep("".join(emitted), None, len(token_ids))

    def flush(self) -> DetokenizerStep:
        """At the end (EOS, length, cancel): release all held text, partial characters included.

        A stop string can still match here when its end was decoded together with an incomplete
        character, so the result is a step rather than plain text.
        """
        if self.is_finished:
            raise RuntimeError("flush() after the detokenizer finished (stop string or flush)")
        self.held_text += self._decode_new_text(allow_partial=True)
        new_text, matched_stop = self._release(final=True)
        self.is_finished = True
        return DetokenizerStep(new_text, matched_stop, 0)

    def _decode_new_text(self, allow_partial: bool = False) -> str:
        """Text of the ids since read_offset, or "" while it would end inside a character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        # No growth: special tokens, or bytes that do not finish a character yet. The window then
        # widens until it decodes to whole characters.
        if len(text) <= len(prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not allow_partial):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, final: bool) -> tuple[str, str | None]:
        """Take from held_text what is safe to emit, and the stop string it ends with, if any."""
        match = find_stop(self.held_text, self.stop)
        if match is not None:
            start, stop = match
            self.is_finished = True
            new_text = self.held_text[: start + len(stop) if self.include_stop else start]
            self.held_text = ""
            return new_text, stop
        num_held = 0 if final else num_held_chars(self.held_text, self.stop)
        new_text = self.held_text[: len(self.held_text) - num_held]
        self.held_text = self.held_text[len(new_text) :]
        return new_text, None
