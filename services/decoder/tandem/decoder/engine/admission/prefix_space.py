"""A chat's text parts tokenized as the one text they render, under SentencePiece's prefix space.

NOTE: a chat renders to one text, but it reaches the tokenizer in parts: the caller's text that could
form a special-token literal is spliced in as plain text (chat.py), each part tokenized alone. A
byte-level BPE joins such parts as they are. A SentencePiece tokenizer (Llama 2, Mistral: a Prepend
"▁" normalizer, gguf_sentencepiece.py) puts a space before each run of text that starts a text or
follows a special token, so each part alone gained a space the rendered text does not have
("[INST]  hi" for "[INST] hi"). A part that continues the previous part's run (that part's last token
is no added token) has its first run tokenized by a twin without the Prepend; the runs after an added
token in it keep their space, as in the whole text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import tokenizers


@dataclass(frozen=True)
class PrefixFree:
    """A tokenizer and its literal copy (special_literals.literal_tokenizer), each with a twin without
    the prefix."""

    tokenizer: tokenizers.Tokenizer  # the model's
    literal: tokenizers.Tokenizer  # special-token literals as plain text: the caller's spliced text
    tokenizer_twin: tokenizers.Tokenizer
    literal_twin: tokenizers.Tokenizer
    added_ids: frozenset[int]  # what `tokenizer` matches whole in a text: a run ends at each
    plain_added_ids: frozenset[int]  # what `literal` matches whole: the non-special added tokens

    def ends_run(self, ids: list[int], is_plain: bool) -> bool:
        """Whether the next part starts a run after a part of these ids: it ended in an added token."""
        return not ids or ids[-1] in (self.plain_added_ids if is_plain else self.added_ids)

    def encode_continuing(self, text: str, is_plain: bool) -> list[int]:
        """`text`'s ids as the middle of a run: its first run, up to the first added token matched,
        without the prefix space; the rest as the tokenizer gives it."""
        tokenizer, twin = (
            (self.literal, self.literal_twin) if is_plain else (self.tokenizer, self.tokenizer_twin)
        )
        added = self.plain_added_ids if is_plain else self.added_ids
        # encode_batch releases the GIL (encode holds it), as prompt.py's tokenizing does.
        encoding = tokenizer.encode_batch([text], add_special_tokens=False)[0]
        start = next(
            (begin for i, (begin, _) in zip(encoding.ids, encoding.offsets, strict=True) if i in added),
            len(text),
        )
        head = twin.encode_batch([text[:start]], add_special_tokens=False)[0].ids if start else []
        if start == len(text):
            return head
        return head + tokenizer.encode_batch([text[start:]], add_special_tokens=False)[0].ids


def prefix_free(tokenizer: tokenizers.Tokenizer, literal: tokenizers.Tokenizer) -> PrefixFree | None:
    """The twins, or None where the tokenizer puts no space before a text (nothing to undo)."""
    if _steps(tokenizer.normalizer)[:1] != ["Prepend"]:  # the normalizer alone: a vocabulary is large
        return None
    twins = []
    for source in (tokenizer, literal):
        spec = json.loads(source.to_str())
        rest = spec["normalizer"]["normalizers"][1:] if spec["normalizer"]["type"] == "Sequence" else []
        spec["normalizer"] = {"type": "Sequence", "normalizers": rest} if rest else None
        twin = tokenizers.Tokenizer.from_str(json.dumps(spec))
        twin.encode_special_tokens = source.encode_special_tokens
        twins.append(twin)
    added = tokenizer.get_added_tokens_decoder()
    return PrefixFree(
        tokenizer=tokenizer,
        literal=literal,
        tokenizer_twin=twins[0],
        literal_twin=twins[1],
        added_ids=frozenset(added),
        plain_added_ids=frozenset(i for i, token in added.items() if not token.special),
    )


def _steps(normalizer: tokenizers.normalizers.Normalizer | None) -> list[str]:
    """The types of a normalizer's steps, in order."""
    if normalizer is None:
        return []
    spec = json.loads(normalizer.__getstate__())
    steps = spec["normalizers"] if spec["type"] == "Sequence" else [spec]
    return [step["type"] for step in steps]
