"""Model hyper-parameters, read from a Hugging Face `config.json`.

`ModelConfig` holds what the model code needs and nothing else. Values the engine derives at run time
(KV block counts, bucket sizes) live with the engine. Two layouts of `config.json` are accepted:
older files with top-level `rope_theta` and `rope_scaling`, and the `rope_parameters` dict that
transformers 5 writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`"rope_type": "llama3"`)."""

    factor: float  # how much the low frequencies are slowed down
    low_freq_factor: float  # wavelengths above original_max / low_freq_factor are fully scaled
    high_freq_factor: float  # wavelengths below original_max / high_freq_factor are left alone
    original_max_position_embeddings: int  # context length the model was pre-trained with


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder checkpoint. Validated when built."""

    architecture: str  # Hugging Face class name, e.g. "Qwen3ForCausalLM"
    vocab_size: int  # rows of the embedding and the LM head; may exceed the tokenizer's vocabulary
    hidden_size: int
    intermediate_size: int  # width of the SwiGLU MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads is a multiple of it (GQA)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None  # None: plain RoPE
    tie_word_embeddings: bool  # the LM head reuses embed_tokens.weight
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]  # generation EOS ids (generation_config.json, else config.json)
    dtype: torch.dtype  # weights, activations and KV cache
    attention_bias: bool = False  # biases on the q/k/v/o projections
    mlp_bias: bool = False  # biases on the gate/up/down projections

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(
        cls, hf_config: dict[str, Any], generation_config: dict[str, Any] | None, dtype: torch.dtype
    ) -> ModelConfig:
        """Builds the config from parsed `config.json` and `generation_config.json` (if any).

        Raises ValueError naming the key for anything missing or unsupported.
        """
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported (only 'silu')")
        if hf_config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        num_heads = _require(hf_config, "num_attention_heads")
        hidden_size = _require(hf_config, "hidden_size")
        rope_theta, rope_scaling = _parse_rope(hf_config)
        eos = (generation_config or {}).get("eos_token_id")
        if eos is None:
            eos = hf_config.get("eos_token_id")
        return cls(
            architecture=_require(hf_config, "architectures")[0],
            vocab_size=_require(hf_config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(hf_config, "intermediate_size"),
            num_layers=_require(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            # Llama 2 checkpoints leave head_dim out; every Qwen3 checkpoint states it.
            head_dim=hf_config.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            max_position_embeddings=_require(hf_config, "max_position_embeddings"),
            eos_token_ids=_as_ids(eos),
            dtype=dtype,
            attention_bias=bool(hf_config.get("attention_bias", False)),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
        )


def _require(hf_config: dict[str, Any], key: str) -> Any:
    value = hf_config.get(key)
    if value is None:
        raise ValueError(f"missing key {key!r}")
    return value


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _parse_rope(hf_config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(_require(rope, "factor")),
            low_freq_factor=float(_require(rope, "low_freq_factor")),
            high_freq_factor=float(_require(rope, "high_freq_factor")),
            original_max_position_embeddings=int(_require(rope, "original_max_position_embeddings")),
        )
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: 'default', 'llama3')")
