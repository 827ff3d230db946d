"""Model hyper-parameters, read from a Hugging Face `config.json`.

`ModelConfig` holds what the model code needs and nothing else. Values the engine derives at run time
(KV block counts, bucket sizes) live with the engine. Two layouts of `config.json` are accepted:
older files with top-level `rope_theta` and `rope_scaling`, and the `rope_parameters` dict that
transformers 5 writes.

The families share one layer and differ in what their config.json keys mean, read here as
transformers' own modelling code reads them: Llama's `attention_bias` puts a bias on q/k/v and o_proj
alike (Qwen3's too); Qwen2 always has q/k/v biases and never an o_proj one, whatever its config says;
Mistral has none. A sliding attention window (Mistral's `sliding_window`, Qwen's `use_sliding_window`)
is recorded, not implemented: the engine refuses a context wider than it (engine/step/sizing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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

MAX_ROPE_FACTOR = 1024.0  # Llama 3.x's RoPE scaling factors: 1 to 32 in use


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`"rope_type": "llama3"`)."""

    factor: float  # how much the low frequencies are slowed down
    low_freq_factor: float  # wavelengths above original_max / low_freq_factor are fully scaled
    high_freq_factor: float  # wavelengths below original_max / high_freq_factor are left alone
    original_max_position_embeddings: int  # context length the model was pre-trained with

    def __post_init__(self) -> None:
        # The band between the two factors is blended by dividing by their difference.
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RoPE scaling's high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class SlidingWindow:
    """A window of keys some layer attends to instead of the whole context (transformers masks the
    rest out): the model is served only where no sequence can grow past it."""

    size: int  # keys a query sees, itself included
    said: str  # the config.json keys that set it, for a refusal: "sliding_window 4096"


QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"})


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
    qkv_bias: bool = False  # biases on the q/k/v projections
    o_bias: bool = False  # a bias on o_proj (Llama's attention_bias; never Qwen2's)
    mlp_bias: bool = False  # biases on the gate/up/down projections
    sliding_window: SlidingWindow | None = None  # None: every layer attends to the whole context

    def __post_init__(self) -> None:
        for name, (key, high) in _INT_FIELDS.items():
            _check_int(key, getattr(self, name), 1, high)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _check_real("rms_norm_eps", self.rms_norm_eps, MAX_RMS_NORM_EPS)
        _check_real("rope_theta", self.rope_theta, MAX_ROPE_THETA)
        for token_id in self.eos_token_ids:
            _check_int("eos_token_id", token_id, 0, self.vocab_size - 1)

    @property
    def has_qk_norm(self) -> bool:
        """Whether the attention has q_norm and k_norm (Qwen3's), for what reads the architecture below the
        model classes (an adapter's config): their use_qk_norm says the same, a test keeps them equal."""
        return self.architecture in QK_NORM_ARCHITECTURES

    @classmethod
    def from_hf(
        cls, hf_config: dict[str, Any], generation_config: dict[str, Any] | None, dtype: torch.dtype
    ) -> ModelConfig:
        """Builds the config from parsed `config.json` and `generation_config.json` (if any).

        Raises ValueError naming the key for anything missing or unsupported.
        """
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported (only 'silu')")
        ints = {
            key: _check_int(key, _require(hf_config, key), 1, high)
            for key, high in _INT_FIELDS.values()
            if key not in _OPTIONAL
        }
        num_heads, hidden_size = ints["num_attention_heads"], ints["hidden_size"]
        head_dim = hf_config.get("head_dim")
        if head_dim is None:  # Llama 2 checkpoints leave it out; every Qwen3 checkpoint states it
            if hidden_size % num_heads:
                raise ValueError(
                    f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) "
                    "and there is no head_dim to say the heads' width"
                )
            head_dim = hidden_size // num_heads
        num_kv_heads = hf_config.get("num_key_value_heads")
        rope_theta, rope_scaling = _parse_rope(hf_config)
        eos, eos_key = (generation_config or {}).get("eos_token_id"), "generation_config.json's eos_token_id"
        if eos is None:
            eos, eos_key = hf_config.get("eos_token_id"), "eos_token_id"
        for token_id in _as_ids(eos):  # named by its file here; __post_init__ cannot tell which
            _check_int(eos_key, token_id, 0, ints["vocab_size"] - 1)
        architecture = _require(hf_config, "architectures")[0]
        qkv_bias, o_bias, mlp_bias = _biases(architecture, hf_config)
        return cls(
            architecture=architecture,
            vocab_size=ints["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=ints["intermediate_size"],
            num_layers=ints["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_real(hf_config, "rms_norm_eps", 1e-6, MAX_RMS_NORM_EPS),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_flag(hf_config, "tie_word_embeddings", False),
            max_position_embeddings=ints["max_position_embeddings"],
            eos_token_ids=_as_ids(eos),
            dtype=dtype,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=_sliding_window(architecture, hf_config, ints["num_hidden_layers"]),
        )


# ModelConfig field -> (config.json key, largest value): errors name the key a reader can look up.
_INT_FIELDS = {
    "vocab_size": ("vocab_size", MAX_VOCAB),
    "hidden_size": ("hidden_size", MAX_HIDDEN_SIZE),
    "intermediate_size": ("intermediate_size", MAX_INTERMEDIATE_SIZE),
    "num_layers": ("num_hidden_layers", MAX_LAYERS),
    "num_heads": ("num_attention_heads", MAX_HEADS),
    "num_kv_heads": ("num_key_value_heads", MAX_HEADS),
    "head_dim": ("head_dim", MAX_HEAD_DIM),
    "max_position_embeddings": ("max_position_embeddings", MAX_POSITIONS),
}
_OPTIONAL = ("num_key_value_heads", "head_dim")  # defaulted from the others when config.json omits them


def _biases(architecture: str, hf_config: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v biases, an o_proj bias, MLP biases) as transformers builds the family's layer."""
    if architecture == "Qwen2ForCausalLM":  # Qwen2Attention: bias=True on q/k/v, False on o_proj
        return True, False, False
    if architecture == "MistralForCausalLM":  # no bias anywhere, whatever the file says
        return False, False, False
    attention_bias = _flag(hf_config, "attention_bias", False)
    return attention_bias, attention_bias, _flag(hf_config, "mlp_bias", False)


def _sliding_window(architecture: str, hf_config: dict[str, Any], num_layers: int) -> SlidingWindow | None:
    """The window some layer attends to, as transformers masks it; None: every layer sees it all.

    Mistral applies `sliding_window` (null in v0.3, 4096 in v0.1) to every layer. Qwen2 and Qwen3 apply
    it only with `use_sliding_window` true (false in every released model), to the layers `layer_types`
    marks "sliding_attention", or without it to those from `max_window_layers` on (28 by default).
    Llama has no window.
    """
    if architecture == "MistralForCausalLM":
        size = _window_size(hf_config)
        return None if size is None else SlidingWindow(size, f"sliding_window {size}")
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    if not _flag(hf_config, "use_sliding_window", False):
        return None
    size = _window_size(hf_config, default=4096)  # Qwen2Config's and Qwen3Config's default
    if size is None:
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types must be a list of {num_layers} layer kinds, got {layer_types!r:.80}"
            )
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        where = f"layer_types marks {len(sliding)} of {num_layers} layers sliding_attention"
    else:
        first = hf_config.get("max_window_layers", 28)
        _check_int("max_window_layers", first, 0, MAX_LAYERS)
        sliding = list(range(first, num_layers))
        where = f"from layer max_window_layers {first} on, of {num_layers}"
    if not sliding:
        return None
    return SlidingWindow(size, f"use_sliding_window true, sliding_window {size} ({where})")


def _window_size(hf_config: dict[str, Any], default: int | None = None) -> int | None:
    """config.json's `sliding_window`: None when null (or absent without a default)."""
    value = hf_config.get("sliding_window", default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sliding_window must be null or a positive integer, got {value!r}")
    return value


def _check_int(key: str, value: Any, low: int, high: int) -> int:
    """`value`, an integer in [low, high]; a bool (true is 1 to Python) or a float is refused."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _check_real(key: str, value: Any, high: float) -> float:
    """`value`, a number in (0, high]: NaN, Infinity (which Python's json reads), a string are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= high:
        raise ValueError(f"{key} must be a number in (0, {high:g}], got {value!r}")
    return float(value)


def _real(config: dict[str, Any], key: str, default: float, high: float) -> float:
    value = config.get(key)
    return _check_real(key, default if value is None else value, high)


def _flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """A JSON boolean; the string "false" is refused rather than read as true."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _require(hf_config: dict[str, Any], key: str) -> Any:
    value = hf_config.get(key)
    if value is None:
        raise ValueError(f"missing key {key!r}")
    return value


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(value)
    return (value,)


def _parse_rope(hf_config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    key = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = hf_config.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key} must be an object, got {type(rope).__name__}")
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    theta = _check_real("rope_theta", 10000.0 if theta is None else theta, MAX_ROPE_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=_check_real(f"{key}.factor", _require(rope, "factor"), MAX_ROPE_FACTOR),
            low_freq_factor=_check_real(
                f"{key}.low_freq_factor", _require(rope, "low_freq_factor"), MAX_ROPE_FACTOR
            ),
            high_freq_factor=_check_real(
                f"{key}.high_freq_factor", _require(rope, "high_freq_factor"), MAX_ROPE_FACTOR
            ),
            original_max_position_embeddings=_check_int(
                f"{key}.original_max_position_embeddings",
                _require(rope, "original_max_position_embeddings"),
                1,
                MAX_POSITIONS,
            ),
        )
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: 'default', 'llama3')")
