"""Vision-language checkpoints split in two: what the decoder and the encoder each read of one directory.

A LLaVA (`LlavaForConditionalGeneration`) or SmolVLM (`Idefics3ForConditionalGeneration`) checkpoint
holds a vision tower, a projector (LLaVA) or connector (Idefics3), and a Llama-architecture language
model. The decoder serves the language model alone: its config is `text_config`, its weights are the
language model's under the prefix this checkpoint uses. The encoder serves the tower and the projector
alone, plus the language model's token table for text. Neither reads the other's weights.

transformers has written two layouts of LLaVA's language model over the years (`language_model.model.*`
with `language_model.lm_head.weight`, and `model.language_model.*` with `lm_head.weight`); which one a
directory holds is read off its weight names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

LLAVA = "LlavaForConditionalGeneration"
IDEFICS3 = "Idefics3ForConditionalGeneration"
ARCHITECTURES = (LLAVA, IDEFICS3)
TEXT_MODEL_TYPES = ("llama",)  # the decoder's LlamaForCausalLM serves these


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
    architectures = hf_config.get("architectures") or []
    return bool(architectures) and architectures[0] in ARCHITECTURES


def text_config(hf_config: dict[str, Any], error: Callable[[str], Exception]) -> dict[str, Any]:
    """The language model's config.json as a causal LM's: `text_config`, named LlamaForCausalLM.

    `tie_word_embeddings` is read where transformers reads it (the outer config for LLaVA), and the
    EOS from the outer config when the text config has none. Raises `error(message)`."""
    architecture = hf_config["architectures"][0]
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise error(f"config.json: {architecture} without a text_config")
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_MODEL_TYPES:
        raise error(
            f"config.json: {architecture} with a {model_type!r} language model is not supported "
            f"(supported: {', '.join(TEXT_MODEL_TYPES)})"
        )
    merged = {**text, "architectures": ["LlamaForCausalLM"]}
    if "tie_word_embeddings" in hf_config:
        merged["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
    if merged.get("eos_token_id") is None and hf_config.get("eos_token_id") is not None:
        merged["eos_token_id"] = hf_config["eos_token_id"]
    return merged


def image_token_id(hf_config: dict[str, Any]) -> int | None:
    """The token the template writes where an image goes (LLaVA's `image_token_index`)."""
    value = hf_config.get("image_token_index", hf_config.get("image_token_id"))
    return value if isinstance(value, int) else None


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
