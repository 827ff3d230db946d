"""Vision-language checkpoints split in two: what the decoder and the encoder each read of one directory.

A LLaVA (`LlavaForConditionalGeneration`) or SmolVLM (`Idefics3ForConditionalGeneration`) checkpoint
holds a vision tower, a projector (LLaVA) or connector (Idefics3), and a Llama, Qwen2 or Mistral
language model (llava-interleave-qwen's is a Qwen2). The decoder serves the language model alone: its
config is `text_config`, named as that family's causal LM, its weights are the language model's under
the prefix this checkpoint uses. The encoder serves the tower and the projector
alone, plus the language model's token table for text. Neither reads the other's weights.

transformers has written two layouts of LLaVA's language model over the years (`language_model.model.*`
with `language_model.lm_head.weight`, and `model.language_model.*` with `lm_head.weight`); which one a
directory holds is read off its weight names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLAVA = "LlavaForConditionalGeneration"
IDEFICS3 = "Idefics3ForConditionalGeneration"
ARCHITECTURES = (LLAVA, IDEFICS3)
# text_config's model_type -> the decoder's causal LM that serves it.
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
TEXT_MODEL_TYPES = tuple(TEXT_ARCHITECTURES)

# What transformers' config classes assume for a key a config.json leaves out, for the keys the decoder
# reads (models/config.py; the rest it defaults as transformers does). The Hub's llava-hf checkpoints
# rely on them: llava-1.5-7b-hf's text_config names little more than its vocabulary.
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}
QWEN2_DEFAULTS: dict[str, Any] = {  # use_sliding_window false and max_window_layers 28 are the decoder's too
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}
MISTRAL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    # Not num_attention_heads, as the decoder assumes for a key left out: MistralConfig says 8.
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    # Left out, MistralConfig's window is v0.1's; the decoder would read none (only null says none).
    "sliding_window": 4096,
}
TEXT_DEFAULTS = {"llama": LLAMA_DEFAULTS, "qwen2": QWEN2_DEFAULTS, "mistral": MISTRAL_DEFAULTS}
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 224,
        "patch_size": 32,
        "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu",
    },
    "siglip_vision_model": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 224,
        "patch_size": 16,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
    },
    "idefics3_vision": {
        "hidden_size": 1152,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "image_size": 224,
        "patch_size": 32,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
    },
}
# A checkpoint without a vision_config or text_config at all gets the architecture's own.
ABSENT_VISION = {
    LLAVA: {
        "model_type": "clip_vision_model",
        "intermediate_size": 4096,
        "hidden_size": 1024,
        "patch_size": 14,
        "image_size": 336,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
    },
    IDEFICS3: {"model_type": "idefics3_vision"},
}
ABSENT_TEXT = {LLAVA: {"model_type": "llama"}, IDEFICS3: {"model_type": "llama", "rms_norm_eps": 1e-5}}
DEFAULT_IMAGE_TOKEN_ID = {LLAVA: 32000, IDEFICS3: 128257}


@dataclass(frozen=True)
class WeightLayout:
    """Where the language model's weights sit: our "model.X" is `model_prefix + X`."""

    model_prefix: str  # e.g. "model.language_model."
    head_name: str  # the LM head's weight, e.g. "lm_head.weight"

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name for a plain causal-LM name ("model.layers.0...", "lm_head.weight")."""
        if name == "lm_head.weight":
            return self.head_name
        return self.model_prefix + name.removeprefix("model.")


PLAIN = WeightLayout("model.", "lm_head.weight")  # a causal LM's own checkpoint
LAYOUTS: dict[str, tuple[WeightLayout, ...]] = {
    LLAVA: (
        WeightLayout("model.language_model.", "lm_head.weight"),  # transformers >= 4.52
        WeightLayout("language_model.model.", "language_model.lm_head.weight"),  # the Hub's llava-hf
    ),
    IDEFICS3: (WeightLayout("model.text_model.", "lm_head.weight"),),
}


def is_vision_language(hf_config: dict[str, Any]) -> bool:
    # Only a list whose first entry is a name names one: `"architectures": 5` or an object raised here
    # (TypeError, KeyError), a traceback at the decoder's start; the loader that reads the list refuses it.
    architectures = hf_config.get("architectures")
    return (
        isinstance(architectures, list)
        and bool(architectures)
        and isinstance(architectures[0], str)
        and architectures[0] in ARCHITECTURES
    )


def stated_vocab_size(model_dir: Path, vocab_size: int, is_vision_language: bool) -> str:
    """Where the checkpoint in `model_dir` states its token table's rows, for both services' refusals of
    its tokenizer.json: config.json's vocab_size, or a vision-language checkpoint's text_config's (its
    language model's table; an outer vocab_size, which older LLaVA configs carry, sizes nothing)."""
    where = "text_config's vocab_size" if is_vision_language else "vocab_size"
    return f"{where} {vocab_size} in {model_dir / 'config.json'}"


def text_config(hf_config: dict[str, Any], error: Callable[[str], Exception]) -> dict[str, Any]:
    """The language model's config.json as a causal LM's: `text_config` with its family's transformers
    defaults for what it leaves out, named as that family's causal LM (TEXT_ARCHITECTURES). Its head is
    tied as transformers ties it, and the EOS comes from the outer config when the text config has none.
    Raises `error(message)`."""
    architecture = hf_config["architectures"][0]
    text = hf_config.get("text_config", ABSENT_TEXT[architecture])
    if not isinstance(text, dict):
        raise error(f"config.json: {architecture}'s text_config is not an object")
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_MODEL_TYPES:
        raise error(
            f"config.json: {architecture} with a {model_type!r} language model is not supported "
            f"(supported: {', '.join(TEXT_MODEL_TYPES)})"
        )
    merged = {**TEXT_DEFAULTS[model_type], **text, "architectures": [TEXT_ARCHITECTURES[model_type]]}
    # transformers ties by the outer config; LlavaConfig copies a tied text config's flag up first.
    tied = bool(hf_config.get("tie_word_embeddings"))
    if architecture == LLAVA:
        tied = tied or bool(text.get("tie_word_embeddings"))
    merged["tie_word_embeddings"] = tied
    if merged.get("eos_token_id") is None and hf_config.get("eos_token_id") is not None:
        merged["eos_token_id"] = hf_config["eos_token_id"]
    return merged


def vision_config(hf_config: dict[str, Any], error: Callable[[str], Exception]) -> dict[str, Any]:
    """The vision tower's config with transformers' defaults for what it leaves out."""
    architecture = hf_config["architectures"][0]
    vision = hf_config.get("vision_config", ABSENT_VISION[architecture])
    if not isinstance(vision, dict):
        raise error(f"config.json: {architecture}'s vision_config is not an object")
    model_type = vision.get("model_type", ABSENT_VISION[architecture]["model_type"])
    if architecture == IDEFICS3:
        # transformers builds Idefics3's tower from its own config class whatever the file names it:
        # SmolVLM-256M's says siglip_vision_model, and its missing keys take idefics3_vision's defaults.
        model_type = "idefics3_vision"
    if model_type not in VISION_DEFAULTS:
        raise error(
            f"config.json: vision tower {model_type!r} is not supported "
            f"(supported: {', '.join(VISION_DEFAULTS)})"
        )
    return {**VISION_DEFAULTS[model_type], **vision, "model_type": model_type}


def image_token_id(hf_config: dict[str, Any]) -> int | None:
    """The token the template writes where an image goes (LLaVA's `image_token_index`); None for a
    checkpoint that takes no images."""
    if not is_vision_language(hf_config):
        return None
    value = hf_config.get("image_token_index", hf_config.get("image_token_id"))
    return value if isinstance(value, int) else DEFAULT_IMAGE_TOKEN_ID[hf_config["architectures"][0]]


def weight_layout(
    architecture: str, names: Collection[str], error: Callable[[str], Exception]
) -> WeightLayout:
    """The layout whose token table `names` (the checkpoint's weight names) holds."""
    if architecture not in LAYOUTS:
        return PLAIN
    for layout in LAYOUTS[architecture]:
        if layout.checkpoint_name("model.embed_tokens.weight") in names:
            return layout
    expected = [layout.checkpoint_name("model.embed_tokens.weight") for layout in LAYOUTS[architecture]]
    raise error(f"{architecture} checkpoint without its language model's token table (one of {expected})")
