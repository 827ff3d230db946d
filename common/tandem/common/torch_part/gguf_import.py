"""Converts a GGUF file (llama.cpp's format) into an ordinary Hugging Face checkpoint directory.

The output is what every other part of Tandem reads: `config.json`, `model.safetensors` (dequantized to
one dtype), `tokenizer.json` rebuilt from the GGUF tokenizer metadata, `tokenizer_config.json` with the
special tokens and the chat template, and `generation_config.json` with the EOS IDs. Serving a GGUF file
is then nothing special: it is imported once and loaded like any checkpoint.

Two facts of the format matter for correctness:
- llama.cpp's converter permutes the rows of Llama's Q and K projections into its own RoPE layout
  (pairs interleaved instead of halves). `_unpermute` undoes it; without it the model still produces
  fluent-looking text that is wrong. Qwen2 and Qwen3 files are written unpermuted.
- GGUF lists a tensor's dimensions fastest-first, the reverse of PyTorch's order.

The reader is the `gguf` package that llama.cpp maintains; every quantization type it can dequantize
is accepted. Anything that cannot be converted raises GGUFImportError with one line naming the
problem (architecture, quantization type, tokenizer kind, a truncated file, a wrong magic).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.model_limits import (
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_RMS_NORM_EPS,
    MAX_ROPE_THETA,
    MAX_VOCAB,
)
from tandem.common.torch_part.gguf_header import GGUFHeaderError, check_header
from tandem.common.torch_part.gguf_metadata import (
    ARCHITECTURES,
    GGUFImportError,
    GGUFMetadata,
    int_in_range,
    one_line,
)
from tandem.common.torch_part.gguf_tokenizer import tokenizer_files
from tandem.common.weight_shapes import TextModelShape, expected_weights, mismatch

# GGUF tensor names (per block, then global) -> Hugging Face names.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
_QK_NAMES = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")  # permuted in Llama files


@dataclass(frozen=True)
class ImportProgress:
    """Reported once per converted tensor, so a caller can print a progress line."""

    num_done: int
    num_tensors: int


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    on_progress: Callable[[ImportProgress], None] | None = None,
) -> Path:
    """Writes the checkpoint directory for `gguf_path` into `out_dir` (created) and returns it.

    Files are written readable by everyone (0644; directories 0755), so a checkpoint can be mounted
    into containers that run as another user. Raises GGUFImportError.
    """
    if dtype not in COMPUTE_NAMES:
        raise GGUFImportError(f"--dtype {dtype!r} is not supported (supported: {', '.join(COMPUTE_NAMES)})")
    gguf_path = Path(gguf_path)
    reader = _open(gguf_path)
    meta = GGUFMetadata(reader, gguf_path)
    hf_config = _hf_config(meta)
    _check_blocks(reader, meta, hf_config["num_hidden_layers"])
    _check_shapes(reader, meta, hf_config)
    _check_types(reader, meta)
    tokenizer_json, tokenizer_config, generation_config = tokenizer_files(meta, hf_config)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(_weights(reader, meta, hf_config, dtype, on_progress))
    if "lm_head.weight" not in weights:
        hf_config["tie_word_embeddings"] = True
    _save_weights(weights, out_dir / "model.safetensors")
    _write_json(out_dir / "config.json", hf_config)
    _write_json(out_dir / "tokenizer.json", tokenizer_json)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config)
    if meta.get_str("tokenizer.chat_template"):
        (out_dir / "chat_template.jinja").write_text(meta.get_str("tokenizer.chat_template"))
    make_world_readable(out_dir)
    return out_dir


def make_world_readable(directory: Path) -> None:
    """0755 on the directory, 0644 on its files: containers running as another uid can read them."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _open(path: Path) -> Any:
    import gguf

    if path.is_dir():
        raise GGUFImportError(f"{path}: a directory, not a GGUF file")
    if not path.exists():
        raise GGUFImportError(f"{path}: no such file")
    if not path.is_file():  # a device (/dev/zero) or a FIFO: read, it would never end or never begin
        raise GGUFImportError(f"{path}: not a regular file, not a GGUF file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFImportError(f"{path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise GGUFImportError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        check_header(path)  # the reader trusts every length it reads: an array of 2^62 values hung it
    except GGUFHeaderError as e:
        raise GGUFImportError(f"{path}: {e}") from None
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, TypeError) as e:
        raise GGUFImportError(f"{path}: unreadable GGUF header ({one_line(e)})") from e


# What a file's metadata says is checked against these before anything is sized from it (a file is
# untrusted input: block_count 10^9 imported, then grew a server past 6 GB); config.json's keys
# have the same ranges (common/model_limits.py).
_RANGES = {
    "block_count": MAX_LAYERS,
    "attention.head_count": MAX_HEADS,
    "attention.head_count_kv": MAX_HEADS,
    "embedding_length": MAX_HIDDEN_SIZE,
    "feed_forward_length": MAX_INTERMEDIATE_SIZE,
    "attention.key_length": MAX_HEAD_DIM,
    "context_length": MAX_POSITIONS,
}
_REAL_RANGES = {"attention.layer_norm_rms_epsilon": MAX_RMS_NORM_EPS, "rope.freq_base": MAX_ROPE_THETA}


def _real_in_range(meta: GGUFMetadata, key: str, value: Any, high: float) -> float:
    """A number in (0, high]: a string, a boolean or a NaN where a number belongs is refused by name."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= high:
        raise GGUFImportError(f"{meta.path}: metadata {key} must be a number in (0, {high:g}], got {value!r}")
    return float(value)


def _hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    def arch_int(key: str, default: Any = None) -> int:
        value = meta.arch(key, default) if default is not None else meta.require(key)
        return int_in_range(meta, f"{meta.architecture}.{key}", value, 1, _RANGES[key])

    def arch_real(key: str, default: float | None) -> float:
        value = meta.arch(key, default) if default is not None else meta.require(key)
        return _real_in_range(meta, f"{meta.architecture}.{key}", value, _REAL_RANGES[key])

    num_heads = arch_int("attention.head_count")
    hidden_size = arch_int("embedding_length")
    if isinstance(meta.arch("attention.head_count_kv"), list):  # per-layer counts (hybrid models)
        raise GGUFImportError(f"{meta.path}: per-layer attention.head_count_kv is not supported")
    num_kv_heads = arch_int("attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads != 0:
        raise GGUFImportError(
            f"{meta.path}: metadata attention.head_count {num_heads} is not a multiple of "
            f"attention.head_count_kv {num_kv_heads}"
        )
    vocab = meta.get("tokenizer.ggml.tokens") or []
    vocab_size = meta.arch("vocab_size", len(vocab))
    int_in_range(meta, f"{meta.architecture}.vocab_size", vocab_size, max(1, len(vocab)), MAX_VOCAB)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[meta.architecture]],
        "model_type": meta.architecture,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": arch_int("feed_forward_length"),
        "num_hidden_layers": arch_int("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": arch_int("attention.key_length", max(1, hidden_size // num_heads)),
        "hidden_act": "silu",
        "max_position_embeddings": arch_int("context_length", 4096),
        "rms_norm_eps": arch_real("attention.layer_norm_rms_epsilon", None),
        "rope_theta": arch_real("rope.freq_base", 10000.0),
        "rope_scaling": None,
        "tie_word_embeddings": False,  # set when the file has no output.weight
        "attention_bias": False,  # set when the file has attention biases
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    scaling = meta.arch("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFImportError(f"{meta.path}: rope scaling {scaling!r} is not supported")
    if meta.architecture in ("qwen2", "qwen3"):  # llama.cpp attends to the whole context
        config |= {"use_sliding_window": False, "sliding_window": None}
    return config


def _check_blocks(reader: Any, meta: GGUFMetadata, num_layers: int) -> None:
    """The file's tensors are blocks 0 .. block_count - 1, no more and no fewer."""
    blocks = {int(t.name.split(".")[1]) for t in reader.tensors if re.match(r"blk\.\d+\.", t.name)}
    if blocks != set(range(num_layers)):
        have = (
            "no blocks"
            if not blocks
            else f"blocks 0-{max(blocks)}"
            if blocks == set(range(len(blocks)))
            else f"{len(blocks)} blocks numbered {min(blocks)}-{max(blocks)}"
        )
        raise GGUFImportError(
            f"{meta.path}: metadata {meta.architecture}.block_count is {num_layers}, the tensors hold {have}"
        )


def _check_shapes(reader: Any, meta: GGUFMetadata, hf_config: dict[str, Any]) -> None:
    """Every tensor the model reads is in the file, of the shape the metadata implies, from the tensor
    infos alone (nothing dequantized). A file whose metadata disagrees with its tensors was imported
    whole, then refused at load, after the server listened, naming the imported copy's tensor."""
    stored = {_hf_name(t.name, meta.path): t for t in reader.tensors if t.name != "rope_freqs.weight"}
    if meta.architecture == "qwen2":  # Qwen2's layer: q/k/v biases always, never an o_proj bias
        has_qkv_bias, has_o_bias = True, False
    else:  # attention_bias, set as the import reads it: all four, when the file has any
        has_qkv_bias = has_o_bias = any(n.endswith("bias") and "self_attn" in n for n in stored)
    shape = TextModelShape(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=hf_config["num_attention_heads"],
        num_kv_heads=hf_config["num_key_value_heads"],
        head_dim=hf_config["head_dim"],
        has_qk_norm=meta.architecture == "qwen3",
        is_tied="lm_head.weight" not in stored,  # as the import ties it
        has_qkv_bias=has_qkv_bias,
        has_o_bias=has_o_bias,
        has_mlp_bias=False,  # a GGUF file names no MLP bias (_BLOCK_NAMES)
    )
    arch = meta.architecture
    keys = {
        "vocab_size": f"{arch}.vocab_size"
        if meta.arch("vocab_size") is not None
        else "tokenizer.ggml.tokens",
        "hidden_size": f"{arch}.embedding_length",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_heads": f"{arch}.attention.head_count",
        "num_kv_heads": f"{arch}.attention.head_count_kv",
        "head_dim": f"{arch}.attention.key_length"
        if meta.arch("attention.key_length") is not None
        else f"head_dim ({arch}.embedding_length / {arch}.attention.head_count)",
    }
    for name, expected in expected_weights(shape, keys).items():
        tensor = stored.get(name)
        if tensor is None:
            raise GGUFImportError(f"{meta.path}: tensor {gguf_name(name)} ({name}) is missing")
        dims = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest-first
        refusal = mismatch(tensor.name, dims, expected, "the metadata")
        if refusal is not None:
            raise GGUFImportError(f"{meta.path}: {refusal}")


def readable_types() -> tuple[str, ...]:
    """The GGML types the gguf package dequantizes, which the import reads every tensor through: each
    probed on one block of zeros, as which it reads grows with its version (0.19 reads neither Q8_1
    and Q8_K, llama.cpp's activation types, nor I8-I64 and F64)."""
    import gguf

    readable = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        readable.append(qtype.name)
    return tuple(readable)


def _check_types(reader: Any, meta: GGUFMetadata) -> None:
    """Every tensor is of a type the gguf package dequantizes, from the tensor infos alone: a file with
    one that is not was dequantized tensor by tensor up to it (minutes of a large file) before refused."""
    readable = readable_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in readable and tensor.name != "rope_freqs.weight":  # never read
            raise GGUFImportError(
                f"{meta.path}: tensor {tensor.name} is of GGML type {tensor.tensor_type.name}, which the "
                f"gguf package cannot dequantize (readable: {', '.join(readable)})"
            )


def _weights(
    reader: Any,
    meta: GGUFMetadata,
    hf_config: dict[str, Any],
    dtype: str,
    on_progress: Callable[[ImportProgress], None] | None,
) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, dequantized tensor in `dtype`) for every tensor of the file."""
    import gguf
    import torch

    from tandem.common.torch_part.torch_dtypes import COMPUTE_DTYPES

    torch_dtype = COMPUTE_DTYPES[dtype]
    tensors = [t for t in reader.tensors if t.name != "rope_freqs.weight"]
    if len(tensors) != len(reader.tensors) and meta.architecture == "llama":
        raise GGUFImportError(f"{meta.path}: rope_freqs (Llama 3.1 RoPE scaling) is not supported")
    for done, tensor in enumerate(tensors, start=1):
        name = _hf_name(tensor.name, meta.path)
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # a readable type: _check_types
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest-first
        array = np.array(array, dtype=np.float32).reshape(shape)  # a writable copy, off the memory map
        if meta.architecture == "llama" and name.endswith(_QK_NAMES):
            heads = "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
            if array.shape[0] % (2 * hf_config[heads]):  # numpy's reshape error named nothing
                raise GGUFImportError(
                    f"{meta.path}: tensor {tensor.name} has {array.shape[0]} rows, not a whole number of "
                    f"{hf_config[heads]} heads ({heads}) of even width"
                )
            array = _unpermute(array, hf_config[heads])
        if name.endswith("bias") and "self_attn" in name and meta.architecture != "qwen2":
            hf_config["attention_bias"] = True  # Qwen2's biases come with its architecture
        yield name, torch.from_numpy(array).to(torch_dtype)
        if on_progress is not None:
            on_progress(ImportProgress(num_done=done, num_tensors=len(tensors)))


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of a Hugging Face checkpoint name (None: no counterpart)."""
    for gguf, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    for gguf, hf in _BLOCK_NAMES.items():
        if match and hf == match.group(2):
            return f"blk.{match.group(1)}.{gguf}"
    return None


def unpermute_rows(hf_name: str, rows: np.ndarray, hf_config: dict[str, Any]) -> np.ndarray:
    """`rows` (any array whose rows are the tensor's output features) of a Llama file's Q or K
    projection put back in Hugging Face's order; anything else as it is."""
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(rows, hf_config["num_attention_heads"])
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(rows, hf_config["num_key_value_heads"])
    return rows


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_PATTERN.fullmatch(name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise GGUFImportError(f"{path}: tensor {name!r} has no Hugging Face counterpart (unsupported model?)")


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation: per head, rows (pair, half) go back to (half, pair).

    llama.cpp writes `w.reshape(heads, 2, rows_per_head // 2, ...).swapaxes(1, 2)`; this is its inverse.
    """
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weight.shape))


def _save_weights(weights: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({name: t.contiguous() for name, t in weights.items()}, tmp, {"format": "pt"})
    os.replace(tmp, path)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
