"""What the decoder and the encoder each read of a vision-language config.json: the same values as
transformers' own config classes, for the terse configs the Hub's checkpoints have."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.common import vision_language
from tandem.common.vision_language import IDEFICS3, LLAVA, text_config, vision_config, weight_layout

# As llava-hf/llava-1.5-7b-hf writes it: the text model names little more than its vocabulary.
LLAVA_15 = {
    "architectures": [LLAVA],
    "image_token_index": 32000,
    "text_config": {
        "model_type": "llama",
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
    },
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llava-1.5": LLAVA_15,
    "llava without sub-configs": {"architectures": [LLAVA]},
    "llava, siglip tower": {"architectures": [LLAVA], "vision_config": {"model_type": "siglip_vision_model"}},
    "idefics3 without sub-configs": {"architectures": [IDEFICS3]},
    "idefics3 as SmolVLM-256M names its tower": {
        "architectures": [IDEFICS3],
        "scale_factor": 4,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 768,
            "image_size": 512,
            "patch_size": 16,
            "num_attention_heads": 12,
        },
    },
    "idefics3, tied text": {
        "architectures": [IDEFICS3],
        "text_config": {
            "model_type": "llama",
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "tie_word_embeddings": True,
        },
    },
}
TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
)
VISION_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
    "layer_norm_eps",
    "hidden_act",
)


def _transformers_config(config: dict[str, Any]) -> Any:
    from transformers import Idefics3Config, LlavaConfig

    cls = LlavaConfig if config["architectures"][0] == LLAVA else Idefics3Config
    return cls.from_dict({k: v for k, v in config.items() if k != "architectures"})


@pytest.mark.parametrize("name", CONFIGS)
def test_the_text_and_vision_configs_are_what_transformers_reads(name: str) -> None:
    ours_text = text_config(CONFIGS[name], ValueError)
    ours_vision = vision_config(CONFIGS[name], ValueError)
    theirs = _transformers_config(CONFIGS[name])
    for key in TEXT_KEYS:
        assert ours_text[key] == getattr(theirs.text_config, key), (name, key)
    for key in VISION_KEYS:
        assert ours_vision[key] == getattr(theirs.vision_config, key), (name, key)
    assert (
        ours_text["tie_word_embeddings"] == theirs.tie_word_embeddings
        or theirs.text_config.tie_word_embeddings
    )
    assert vision_language.image_token_id(CONFIGS[name]) == theirs.image_token_id


def test_a_language_model_other_than_llama_is_refused_by_name() -> None:
    config = {"architectures": [LLAVA], "text_config": {"model_type": "qwen2"}}
    with pytest.raises(ValueError, match="'qwen2' language model is not supported"):
        text_config(config, ValueError)


def test_a_vision_tower_we_do_not_implement_is_refused_by_name() -> None:
    config = {"architectures": [LLAVA], "vision_config": {"model_type": "pixtral"}}
    with pytest.raises(ValueError, match="vision tower 'pixtral' is not supported"):
        vision_config(config, ValueError)


@pytest.mark.parametrize(
    ("names", "embed_tokens"),
    [
        ({"model.language_model.embed_tokens.weight"}, "model.language_model.embed_tokens.weight"),
        ({"language_model.model.embed_tokens.weight"}, "language_model.model.embed_tokens.weight"),
    ],
)
def test_either_llava_layout_is_found_from_the_weight_names(names: set[str], embed_tokens: str) -> None:
    layout = weight_layout(LLAVA, names, ValueError)
    assert layout.checkpoint_name("model.embed_tokens.weight") == embed_tokens
    assert layout.checkpoint_name("model.layers.3.mlp.up_proj.weight").endswith("layers.3.mlp.up_proj.weight")


def test_a_checkpoint_without_its_language_models_table_is_refused() -> None:
    with pytest.raises(ValueError, match="without its language model's token table"):
        weight_layout(IDEFICS3, {"model.vision_model.x"}, ValueError)


def test_a_text_model_is_not_vision_language() -> None:
    assert not vision_language.is_vision_language({"architectures": ["LlamaForCausalLM"]})
    assert (
        vision_language.image_token_id({"architectures": ["LlamaForCausalLM"], "image_token_id": 5}) is None
    )
