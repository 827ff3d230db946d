"""The shape of every weight of a Llama, Mistral or Qwen language model, from its hyper-parameters.

A checkpoint whose config disagrees with its weights (num_attention_heads 5 beside a q_proj holding 9
heads' rows, a vocab_size that is not embed_tokens' row count) used to be refused only once the model
was built and each weight read, after the server listened. The weights' shapes are in the safetensors
headers (a GGUF file's tensor infos), which are parsed before that, so every weight is compared with
what the config implies here, without building a model or reading a tensor. Names are Hugging Face's
("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"); a vision-language checkpoint's prefix is
the caller's to add. Each dimension carries the keys it comes from, so a refusal can say which one
disagrees, in the terms of whatever file stated them (config.json's keys, or GGUF metadata's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

# The names a refusal gives each hyper-parameter, by TextModelShape field: config.json's keys.
CONFIG_KEYS: Mapping[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}


@dataclass(frozen=True)
class TextModelShape:
    """What sizes a Llama, Mistral, Qwen2 or Qwen3 language model's weights. Validated by whoever read
    it (ModelConfig, the GGUF importer's ranges): every size here is a positive integer."""

    vocab_size: int  # rows of embed_tokens and of lm_head
    hidden_size: int
    intermediate_size: int  # rows of gate_proj and up_proj, columns of down_proj
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads
    head_dim: int  # each head's width (stated, or hidden_size / num_heads)
    has_qk_norm: bool  # Qwen3: q_norm and k_norm of head_dim each
    is_tied: bool  # no lm_head.weight: the head reads embed_tokens.weight
    has_qkv_bias: bool  # q/k/v_proj.bias (Llama's attention_bias, always Qwen2's)
    has_o_bias: bool  # o_proj.bias (Llama's attention_bias, never Qwen2's)
    has_mlp_bias: bool  # gate/up/down_proj.bias


@dataclass(frozen=True)
class ExpectedWeight:
    """One weight as the hyper-parameters size it."""

    shape: tuple[int, ...]
    meaning: str  # each dimension's keys and values: "num_attention_heads 9 x head_dim 64, hidden_size 576"


def expected_weights(
    shape: TextModelShape, keys: Mapping[str, str] = CONFIG_KEYS
) -> dict[str, ExpectedWeight]:
    """Every weight the model reads, by Hugging Face name, in the order the model holds them.

    `keys` names each hyper-parameter in a refusal (CONFIG_KEYS, or a GGUF file's metadata keys)."""

    def dim(*fields: str) -> tuple[int, str]:
        value = math.prod(getattr(shape, f) for f in fields)
        return value, " x ".join(f"{keys[f]} {getattr(shape, f)}" for f in fields)

    hidden, vocab, inter = dim("hidden_size"), dim("vocab_size"), dim("intermediate_size")
    q_rows, kv_rows = dim("num_heads", "head_dim"), dim("num_kv_heads", "head_dim")
    layer: dict[str, tuple[tuple[int, str], ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
    }
    if shape.has_qkv_bias:
        layer |= {
            "self_attn.q_proj.bias": (q_rows,),
            "self_attn.k_proj.bias": (kv_rows,),
            "self_attn.v_proj.bias": (kv_rows,),
        }
    if shape.has_o_bias:
        layer["self_attn.o_proj.bias"] = (hidden,)
    if shape.has_qk_norm:
        layer |= {
            "self_attn.q_norm.weight": (dim("head_dim"),),
            "self_attn.k_norm.weight": (dim("head_dim"),),
        }
    layer |= {
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if shape.has_mlp_bias:
        layer |= {
            "mlp.gate_proj.bias": (inter,),
            "mlp.up_proj.bias": (inter,),
            "mlp.down_proj.bias": (hidden,),
        }
    dims = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(shape.num_layers):
        dims |= {f"model.layers.{i}.{name}": d for name, d in layer.items()}
    dims["model.norm.weight"] = (hidden,)
    if not shape.is_tied:
        dims["lm_head.weight"] = (vocab, hidden)
    return {
        name: ExpectedWeight(tuple(v for v, _ in d), ", ".join(m for _, m in d)) for name, d in dims.items()
    }


# TextModelShape's flags: each adds or removes weights of the same architecture's layer or head.
FLAGS = ("has_qk_norm", "is_tied", "has_qkv_bias", "has_o_bias", "has_mlp_bias")


def flagged_weights(shape: TextModelShape) -> dict[str, str]:
    """The weights the model would read were one of its flags the other way, by Hugging Face name ->
    that flag (a FLAGS field): q_proj.bias under attention_bias false, lm_head.weight under a tied head.

    A checkpoint holding one was written for another config, and a model built from this one would
    serve without it: a dropped bias gives other outputs and no sign of why."""
    expected = expected_weights(shape)
    flagged: dict[str, str] = {}
    for flag in FLAGS:
        other = dataclasses.replace(shape, **{flag: not getattr(shape, flag)})
        flagged |= {name: flag for name in expected_weights(other) if name not in expected}
    return flagged


def token_table(vocab_size: int, hidden_size: int, keys: Mapping[str, str] = CONFIG_KEYS) -> ExpectedWeight:
    """embed_tokens.weight alone, for a reader of the table and nothing else (the encoder)."""
    meaning = f"{keys['vocab_size']} {vocab_size}, {keys['hidden_size']} {hidden_size}"
    return ExpectedWeight((vocab_size, hidden_size), meaning)


# The types a weight may be stored in (safetensors' names). Integer and 8-bit-or-narrower float tensors
# are quantized data (GPTQ's packed int32, FP8's e4m3 beside a scale) that a cast would silently turn
# into other numbers.
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")


def type_refusal(name: str, stored: str) -> str | None:
    """The refusal of weight `name` stored as safetensors type `stored` where it is no WEIGHT_DTYPES
    one; None when a weight may be read from it."""
    if stored in WEIGHT_DTYPES:
        return None
    return (
        f"weight {name} is stored as {stored}, not a type a weight is read from "
        f"(supported: {', '.join(WEIGHT_DTYPES)})"
    )


def mismatch(name: str, stored: tuple[int, ...], expected: ExpectedWeight, source: str) -> str | None:
    """The refusal of weight `name` stored as `stored` where `source` (e.g. "config.json") sizes it as
    `expected`; None when they agree."""
    if tuple(stored) == expected.shape:
        return None
    return (
        f"weight {name} has shape {list(stored)} in the file, but {source} implies "
        f"{list(expected.shape)} ({expected.meaning})"
    )
