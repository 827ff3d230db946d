"""A GGUF file's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral) written as
the parts of a Hugging Face tokenizer.json.

NOTE: llama.cpp's SPM tokenizer, which the file is served by elsewhere, is the reference. It
- prepends a space to every run of raw text that starts the input or follows a special token (control,
  unknown or user-defined), when `tokenizer.ggml.add_space_prefix` (default true), and writes every
  space as "▁";
- starts from the text's characters and repeatedly joins the adjacent pair whose join is a piece of the
  highest score; a character that is no piece falls back to its UTF-8 bytes, the pieces <0x00>..<0xFF>.
A BPE model whose merges are ranked by the score of the piece they make joins the same pairs in the
same order, so the file's scores become merges when the file lists none. The prefix is a normalizer
(Prepend), not Metaspace's "first" scheme: the tokenizers library normalizes each run between added
tokens apart, which is llama.cpp's rule (transformers' GGUF reader prefixes the first run only, so
"<s>[INST]" becomes "[" where Llama 2 and Mistral were trained on "▁[").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
# GGUF token types (llama.cpp's llama_token_type); 0 (undefined) is never written by its converter.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TYPE_NAMES = {
    NORMAL: "normal",
    UNKNOWN: "unknown",
    CONTROL: "control",
    USER_DEFINED: "user-defined",
    UNUSED: "unused",
    BYTE: "byte",
}


class SentencePieceError(ValueError):
    """A vocabulary that cannot be served as llama.cpp would; one line naming the GGUF field."""


@dataclass(frozen=True)
class SentencePieceVocab:
    """What the file says of its SentencePiece tokenizer."""

    tokens: list[str]  # [vocab_size] the pieces, spaces spelled "▁", bytes "<0x0A>"
    scores: list[float]  # [vocab_size] the piece's merge priority: higher joins first
    types: list[int]  # [vocab_size] GGUF token type of each piece (NORMAL ... BYTE)
    merges: list[str] | None  # "left right" pairs, highest priority first, where the file lists them
    unknown_id: int | None  # tokenizer.ggml.unknown_token_id
    add_space_prefix: bool  # tokenizer.ggml.add_space_prefix: a space before each run of text


def byte_piece(byte: int) -> str:
    return f"<0x{byte:02X}>"


def check_vocab(vocab: SentencePieceVocab) -> None:
    """Raises SentencePieceError naming the first field that makes the vocabulary unusable."""
    num_tokens = len(vocab.tokens)
    if len(vocab.scores) != num_tokens:
        raise SentencePieceError(
            f"tokenizer.ggml.scores has {len(vocab.scores)} entries for {num_tokens} tokenizer.ggml.tokens"
        )
    if len(vocab.types) != num_tokens:
        raise SentencePieceError(
            f"tokenizer.ggml.token_type has {len(vocab.types)} entries for {num_tokens} tokenizer.ggml.tokens"
        )
    for i, score in enumerate(vocab.scores):  # a NaN leaves the merge order undefined
        if not math.isfinite(score):
            raise SentencePieceError(f"tokenizer.ggml.scores[{i}] must be a finite number, got {score!r}")
    bytes_ = {byte_piece(b) for b in range(256)}
    for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind not in TYPE_NAMES:
            raise SentencePieceError(
                f"tokenizer.ggml.token_type[{i}] is {kind}, not a token type "
                f"({', '.join(f'{k} {name}' for k, name in TYPE_NAMES.items())})"
            )
        if kind == BYTE and token not in bytes_:  # llama.cpp reads the byte out of the spelling
            raise SentencePieceError(
                f"tokenizer.ggml.tokens[{i}] {token!r:.40} is of token_type {BYTE} (byte) "
                "but is not one of <0x00>..<0xFF>"
            )
    pieces = set(vocab.tokens)
    for b in range(256):
        # A character that is no piece falls back to its bytes: every byte of a character beyond
        # ASCII, and an ASCII byte unless its character is a piece itself.
        if byte_piece(b) not in pieces and not (b < 0x80 and chr(b).replace(" ", SPACE) in pieces):
            raise SentencePieceError(
                f"tokenizer.ggml.tokens has no {byte_piece(b)}, the byte fallback piece for a character "
                "no piece spells"
            )
    for i, merge in enumerate(vocab.merges or []):
        left, _, right = merge.partition(" ")
        for part in (left, right, left + right):
            if part not in pieces:  # the tokenizers library refuses such a merge at load
                raise SentencePieceError(
                    f"tokenizer.ggml.merges[{i}] {merge!r:.40}: {part!r:.40} is not in tokenizer.ggml.tokens"
                )
    if vocab.unknown_id is not None and not 0 <= vocab.unknown_id < num_tokens:
        raise SentencePieceError(
            f"tokenizer.ggml.unknown_token_id must be an integer in [0, {num_tokens - 1}], "
            f"got {vocab.unknown_id}"
        )


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ranked by the whole piece's score, highest first.

    Pairs of equal score keep a fixed order (longer left part first, then the vocabulary's order),
    the order transformers' GGUF reader gives them, so both tokenize a file alike.
    """
    ids = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [
            (token[:n], token[n:]) for n in range(1, len(token)) if token[:n] in ids and token[n:] in ids
        ]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((score, len(left), len(right), left, right) for left, right in splits)
    candidates.sort(key=lambda c: c[:3], reverse=True)  # stable: equal keys keep the order above
    return [(left, right) for _, _, _, left, right in candidates]


def special_ids(vocab: SentencePieceVocab) -> list[int]:
    """Pieces llama.cpp matches whole in a text, never split: control, unknown and user-defined."""
    return [i for i, kind in enumerate(vocab.types) if kind in (CONTROL, UNKNOWN, USER_DEFINED)]


def tokenizer_parts(vocab: SentencePieceVocab) -> dict[str, Any]:
    """tokenizer.json's normalizer, pre_tokenizer, decoder and model for a checked vocabulary."""
    replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    prepend = {"type": "Prepend", "prepend": SPACE}
    normalizer = {
        "type": "Sequence",
        "normalizers": [prepend, replace_space] if vocab.add_space_prefix else [replace_space],
    }
    # "▁" back to a space before the bytes are joined (llama.cpp writes a byte piece's byte as it is),
    # and the prefix's space off the text's start.
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if vocab.add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    if vocab.merges is not None:
        merges = [list(merge.split(" ", 1)) for merge in vocab.merges]
    else:
        merges = [list(pair) for pair in merges_from_scores(vocab.tokens, vocab.scores)]
    unknown = vocab.unknown_id
    if unknown is None:
        unknown = next((i for i, kind in enumerate(vocab.types) if kind == UNKNOWN), None)
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": vocab.tokens[unknown] if unknown is not None else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": {token: i for i, token in enumerate(vocab.tokens)},
        "merges": merges,
    }
    return {
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }
