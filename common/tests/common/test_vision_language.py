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


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM")],
)
@pytest.mark.parametrize("outer", [LLAVA, IDEFICS3])
def test_each_language_model_family_is_its_causal_lm_with_that_familys_defaults(
    model_type: str, architecture: str, outer: str
) -> None:
    """A text_config naming only its family reads as transformers' config class for that family does,
    for every key the decoder reads (a key absent from ours is one the decoder defaults as transformers
    does: num_key_value_heads to num_attention_heads, no sliding window)."""
    config = {"architectures": [outer], "text_config": {"model_type": model_type}}
    ours = text_config(config, ValueError)
    theirs = _transformers_config(config).text_config
    assert ours["architectures"] == [architecture]
    for key in TEXT_KEYS:
        assert ours[key] == getattr(theirs, key), key
    assert ours.get("num_key_value_heads", ours["num_attention_heads"]) == theirs.num_key_value_heads
    assert ours.get("sliding_window") == getattr(theirs, "sliding_window", None)
    assert bool(ours.get("use_sliding_window")) == bool(getattr(theirs, "use_sliding_window", False))


def test_what_the_text_config_states_wins_over_its_familys_defaults() -> None:
    # llava-interleave-qwen-0.5b-hf's text model, in the keys that differ from Qwen2Config's.
    stated = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "vocab_size": 152000,
    }
    ours = text_config({"architectures": [LLAVA], "text_config": stated}, ValueError)
    assert {key: ours[key] for key in stated} == stated
    assert ours["max_position_embeddings"] == 32768  # Qwen2Config's, not Llama's 2048


def test_a_mistral_text_config_with_a_null_window_keeps_it_null() -> None:
    config = {"architectures": [LLAVA], "text_config": {"model_type": "mistral", "sliding_window": None}}
    assert text_config(config, ValueError)["sliding_window"] is None


def test_a_language_model_of_another_family_is_refused_naming_it_and_the_supported_ones() -> None:
    config = {"architectures": [LLAVA], "text_config": {"model_type": "gemma"}}
    with pytest.raises(ValueError) as refused:
        text_config(config, ValueError)
    assert str(refused.value) == (
        f"config.json: {LLAVA} with a 'gemma' language model is not supported "
        "(supported: llama, qwen2, mistral)"
    )


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
