"""A GGUF file's tokenizer metadata rebuilt as tokenizer.json, tokenizer_config.json and
generation_config.json: byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen, SmolLM2) from the
file's merges and pre-tokenizer, SentencePiece ("llama": Llama 2, Mistral) from its pieces and scores
(gguf_sentencepiece.py). Every array is checked for its kind and bounds before anything is written."""

from __future__ import annotations

from typing import Any

from tandem.common.torch_part.gguf_metadata import (
    GGUFImportError,
    GGUFMetadata,
    flag,
    int_in_range,
    list_of,
)
from tandem.common.torch_part.gguf_sentencepiece import (
    SentencePieceError,
    SentencePieceVocab,
    check_vocab,
    special_ids,
    tokenizer_parts,
)
from tandem.common.wire_limits import MAX_TEMPLATE_CHARS

MAX_TOKEN_CHARS = 1024  # one vocabulary entry; the text bounds divide by the longest (text_bounds.py)

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# Byte-level BPE pre-tokenizer split patterns, by `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp).
# Each entry is the list of regexes applied in turn before the byte-level mapping.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then GPT-2's rule
    "qwen2": [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "llama-bpe": [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
}


def tokenizer_files(
    meta: GGUFMetadata, hf_config: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """tokenizer.json (byte-level BPE, or SentencePiece's pieces and scores: gguf_sentencepiece.py),
    tokenizer_config.json and generation_config.json."""
    kind = meta.get_str("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFImportError(
            f"{meta.path}: tokenizer.ggml.model {kind!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece)"
        )
    pre = meta.get_str("tokenizer.ggml.pre") or "default"
    if kind == "gpt2" and pre not in _PRE_TOKENIZERS:
        raise GGUFImportError(
            f"{meta.path}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    tokens: list[str] = list_of(meta, "tokenizer.ggml.tokens", str)
    types: list[int] = list_of(meta, "tokenizer.ggml.token_type", int) or [_NORMAL] * len(tokens)
    merges: list[str] = list_of(meta, "tokenizer.ggml.merges", str)
    if not tokens or len(types) != len(tokens):
        raise GGUFImportError(f"{meta.path}: tokenizer.ggml.tokens / token_type missing or inconsistent")
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]))
    if len(tokens[longest]) > MAX_TOKEN_CHARS:
        raise GGUFImportError(
            f"{meta.path}: tokenizer.ggml.tokens[{longest}] has {len(tokens[longest])} characters, "
            f"more than {MAX_TOKEN_CHARS}"
        )
    first = {}
    for i, entry in enumerate(tokens):  # a repeat left a vocabulary the tokenizers library refused at load
        if first.setdefault(entry, i) != i:
            raise GGUFImportError(
                f"{meta.path}: tokenizer.ggml.tokens[{i}] {entry!r} repeats entry {first[entry]}"
            )
    for i, merge in enumerate(merges):
        if " " not in merge:
            raise GGUFImportError(
                f"{meta.path}: tokenizer.ggml.merges[{i}] {merge!r} is not two tokens and a space"
            )
    for key in ("bos", "eos", "eot", "unknown", "padding"):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None:
            int_in_range(meta, f"tokenizer.ggml.{key}_token_id", index, 0, len(tokens) - 1)
    template = meta.get_str("tokenizer.chat_template") or ""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise GGUFImportError(
            f"{meta.path}: tokenizer.chat_template has {len(template)} characters, "
            f"more than {MAX_TEMPLATE_CHARS}"
        )
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = flag(meta, "tokenizer.ggml.add_bos_token", default=kind == "llama")
    add_eos = flag(meta, "tokenizer.ggml.add_eos_token")
    if kind == "llama":
        parts, whole = _sentencepiece_parts(meta, tokens, types, merges)
    else:
        parts, whole = (
            _byte_level_parts(pre, tokens, merges),
            [i for i, kind_ in enumerate(types) if kind_ in (_CONTROL, _USER_DEFINED)],
        )
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] != _USER_DEFINED,
        }
        for i in whole
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "post_processor": _post_processor(meta, tokens, add_bos, add_eos),
        **parts,
    }

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    eos_ids = [
        i
        for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
        if isinstance(i, int)
    ]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config["max_position_embeddings"],
        "chat_template": meta.get_str("tokenizer.chat_template"),
    }
    generation_config = {"eos_token_id": list(dict.fromkeys(eos_ids)) or None}
    if isinstance(meta.get("tokenizer.ggml.bos_token_id"), int):
        generation_config["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    return tokenizer_json, tokenizer_config, generation_config


def _byte_level_parts(pre: str, tokens: list[str], merges: list[str]) -> dict[str, Any]:
    """tokenizer.json's normalizer, pre_tokenizer, decoder and model for byte-level BPE."""
    splits = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in _PRE_TOKENIZERS[pre]
    ]
    # The splits above already did the regex's work; ByteLevel only maps bytes to its alphabet.
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }


def _sentencepiece_parts(
    meta: GGUFMetadata, tokens: list[str], types: list[int], merges: list[str]
) -> tuple[dict[str, Any], list[int]]:
    """The SentencePiece vocabulary's tokenizer.json parts and the ids matched whole in a text."""
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list):
        raise GGUFImportError(
            f"{meta.path}: metadata tokenizer.ggml.scores must be an array, got {scores!r:.40}"
        )
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise GGUFImportError(
                f"{meta.path}: metadata tokenizer.ggml.scores[{i}] must be a number, got {score!r:.40}"
            )
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    vocab = SentencePieceVocab(
        tokens=tokens,
        scores=[float(score) for score in scores],
        types=types,
        merges=merges if meta.get("tokenizer.ggml.merges") is not None else None,
        unknown_id=unknown if isinstance(unknown, int) else None,
        add_space_prefix=flag(meta, "tokenizer.ggml.add_space_prefix", default=True),
    )
    try:
        check_vocab(vocab)
    except SentencePieceError as e:
        raise GGUFImportError(f"{meta.path}: {e}") from None
    return tokenizer_parts(vocab), special_ids(vocab)


def _post_processor(
    meta: GGUFMetadata, tokens: list[str], add_bos: bool, add_eos: bool
) -> dict[str, Any] | None:
    """BOS before and EOS after a text where the file says the tokenizer adds them (Llama 3 and Llama 2
    add BOS; SmolLM2 adds neither)."""
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    before = [(tokens[bos], bos)] if add_bos and isinstance(bos, int) else []
    after = [(tokens[eos], eos)] if add_eos and isinstance(eos, int) else []
    if not before and not after:
        return None

    def special(name: str, type_id: int) -> dict[str, Any]:
        return {"SpecialToken": {"id": name, "type_id": type_id}}

    def sequence(name: str, type_id: int) -> dict[str, Any]:
        return {"Sequence": {"id": name, "type_id": type_id}}

    return {
        "type": "TemplateProcessing",
        "single": [*(special(n, 0) for n, _ in before), sequence("A", 0), *(special(n, 0) for n, _ in after)],
        "pair": [
            *(special(n, 0) for n, _ in before),
            sequence("A", 0),
            *(special(n, 0) for n, _ in after),
            *(special(n, 1) for n, _ in before),
            sequence("B", 1),
            *(special(n, 1) for n, _ in after),
        ],
        "special_tokens": {name: {"id": name, "ids": [i], "tokens": [name]} for name, i in before + after},
    }
