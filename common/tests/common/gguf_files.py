"""Writes small GGUF files the way llama.cpp's converter does, from a Hugging Face model in memory.

The tests import these files with Tandem's importer and compare the result with the original weights
and with transformers' own GGUF loader, an independent reader of the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

Q = gguf.GGMLQuantizationType
# Every type the gguf package can both write (quantize) and read; the K- and IQ-quants it only reads go
# through the same gguf.quants.dequantize call.
WRITABLE_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]

_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass(frozen=True)
class SentencePieceFields:
    """The tokenizer fields llama.cpp's converter writes for a SentencePiece model (Llama 2, Mistral)."""

    tokens: list[str]  # [vocab_size] pieces, "▁" for a space
    scores: list[float]  # [vocab_size]
    types: list[int]  # [vocab_size] 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    bos_id: int
    eos_id: int
    unknown_id: int
    add_bos: bool | None = True  # None: the field left out, as older files do
    merges: list[str] | None = None  # most files list none: the scores rank the merges
    add_space_prefix: bool | None = None  # None: the field left out (llama.cpp's default: true)


def sentencepiece_fields() -> SentencePieceFields:
    """A small Llama-2-like vocabulary: <unk> <s> </s>, the 256 byte pieces, joined pieces whose scores
    fall with their rank, single characters below them, one user-defined and one unused piece. No
    newline, CJK or most punctuation pieces: those take the byte fallback."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *[6] * 256]
    joined = "▁t er in ▁a en on ▁th es ▁the ▁s ll he ▁he llo ▁hello ▁w or ▁wor ld ▁world ▁▁ ▁▁▁▁ ▁H ▁Hello"
    characters = list("▁etaoinshrdlucmfwypvbgkqjxzETAOINSHRDLUCMFWYPVBGKQJXZ0123456789,.!?'[]/-é")
    pieces = [*joined.split(), "ing", "▁in", *characters]
    tokens += pieces
    types += [1] * len(pieces)
    tokens += ["<tool>", "<unused0>"]
    types += [4, 5]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return SentencePieceFields(tokens, scores, types, bos_id=1, eos_id=2, unknown_id=0)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama's Q and K rows (written independently)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}"


def write_gguf(
    path: Path,
    hf_model: Any,
    tokenizer: Tokenizer | SentencePieceFields,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    chat_template: str | None = None,
    pre: str = "gpt2",
    raw_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """`hf_model` (LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM) as a GGUF file; 2-D weights
    in `qtype`, biases and norms in F32 (as llama.cpp writes 1-D tensors).

    `raw_tensors` replaces tensors (by GGUF name) with given bytes of a given type; `metadata`
    replaces the values written under its keys (e.g. "llama.block_count": 10**9: a hostile file).
    """
    config = hf_model.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    written: set[str] = set()
    if metadata:
        write = writer.add_key_value

        def add_key_value(key: str, val: Any, vtype: Any, sub_type: Any = None) -> None:
            written.add(key)
            if key in metadata:
                val = metadata[key]
                if isinstance(val, int) and not 0 <= val < 1 << 32:
                    vtype = gguf.GGUFValueType.INT64 if val < 0 else gguf.GGUFValueType.UINT64
                if isinstance(val, str):  # a value stored under the wrong type, as a hostile file may
                    vtype = gguf.GGUFValueType.STRING
            write(key, val, vtype, sub_type)

        writer.add_key_value = add_key_value  # type: ignore[method-assign]
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads  # Qwen2 states none
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(int(qtype))

    if isinstance(tokenizer, SentencePieceFields):
        _write_sentencepiece(writer, tokenizer)
    else:
        _write_byte_level(writer, tokenizer, pre, config.vocab_size)
    if chat_template:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():  # keys this file would not have had
        if key not in written and isinstance(value, str):
            writer.add_string(key, value)

    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        data, kwargs = _encode(array, qtype if array.ndim == 2 else None)
        if gguf_name(name) in (raw_tensors or {}):
            data, raw_type = raw_tensors[gguf_name(name)]
            kwargs = {"raw_dtype": raw_type}
        writer.add_tensor(gguf_name(name), data, **kwargs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def mixed_types(
    model: torch.nn.Module, types: dict[str, gguf.GGMLQuantizationType]
) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """raw_tensors for write_gguf: the Llama `model`'s tensors named in `types` (Hugging Face names) in
    those types, Q and K rows in llama.cpp's order as the writer puts them."""
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    raw = {}
    for name, qtype in types.items():
        array = model.state_dict()[name].float().numpy()
        projection = name.rsplit(".", 2)[-2]
        if projection in heads:
            array = llama_cpp_permute(array, heads[projection])
        raw[gguf_name(name)] = (gguf.quants.quantize(array, qtype), qtype)
    return raw


def _write_byte_level(writer: gguf.GGUFWriter, tokenizer: Tokenizer, pre: str, vocab_size: int) -> None:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    model_json = json.loads(tokenizer.to_str())["model"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    padded = tokens + [f"[PAD{i}]" for i in range(vocab_size - len(tokens))]
    writer.add_token_list(padded)
    writer.add_token_types([3 if t in specials else (5 if t.startswith("[PAD") else 1) for t in padded])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model_json["merges"]])
    eos = tokenizer.token_to_id("<|endoftext|>")
    writer.add_eos_token_id(eos)
    writer.add_bos_token_id(eos)
    writer.add_add_bos_token(False)


def _write_sentencepiece(writer: gguf.GGUFWriter, fields: SentencePieceFields) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(fields.tokens)
    writer.add_token_scores(fields.scores)
    writer.add_token_types(fields.types)
    if fields.merges is not None:
        writer.add_token_merges(fields.merges)
    writer.add_bos_token_id(fields.bos_id)
    writer.add_eos_token_id(fields.eos_id)
    writer.add_unk_token_id(fields.unknown_id)
    if fields.add_bos is not None:
        writer.add_add_bos_token(fields.add_bos)
    writer.add_add_eos_token(False)
    if fields.add_space_prefix is not None:
        writer.add_add_space_prefix(fields.add_space_prefix)


def _encode(array: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> tuple[np.ndarray, dict]:
    q = gguf.GGMLQuantizationType
    if qtype is None or qtype == q.F32:
        return np.ascontiguousarray(array, dtype=np.float32), {}
    if qtype == q.F16:
        return array.astype(np.float16), {}
    return gguf.quants.quantize(array, qtype), {"raw_dtype": qtype}


def small_model(arch: str, vocab_size: int) -> torch.nn.Module:
    """A 2-layer Llama, Qwen2 or Qwen3 of `vocab_size` from transformers, random weights far enough from
    its initial ones that a misplaced tensor shows (Qwen2's q/k/v biases too)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # transformers' GGUF reader leaves Qwen3's head_dim at its default, 128 (as in the real models)
        head_dim=128 if arch == "qwen3" else 16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=arch != "llama",
    )
    # Here, not at the top: .venv-xla has no transformers, and its tests write files from checkpoints
    # on disk (tests/xla/test_quantized.py).
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    classes = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config),
    }
    model_class, config_class = classes[arch]
    model = model_class(config_class(**common))
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    return model.train(False)
