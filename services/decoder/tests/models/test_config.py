"""The decoder's model config (models/config.py) from the configs checkpoints carry."""

from __future__ import annotations

import pytest
import torch

from common.tests.common.test_vision_language import LLAVA_15
from tandem.common.vision_language import text_config
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.registry import MODEL_CLASSES


def test_the_decoder_builds_its_model_config_from_the_text_config() -> None:
    config = ModelConfig.from_hf(text_config(LLAVA_15, ValueError), None, torch.bfloat16)
    assert (config.architecture, config.hidden_size, config.num_layers, config.vocab_size) == (
        "LlamaForCausalLM",
        4096,
        32,
        32064,
    )
    assert config.num_kv_heads == 32 and config.rms_norm_eps == 1e-5


QWEN3: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
    "eos_token_id": 1000,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
NAN, INF = float("nan"), float("inf")  # what Python's json reads NaN and Infinity as


def test_a_valid_config_builds() -> None:
    config = ModelConfig.from_hf(QWEN3, None, torch.float32)
    assert (config.num_layers, config.head_dim, config.eos_token_ids, config.tie_word_embeddings) == (
        2,
        16,
        (1000,),
        True,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be an integer in \[1, 1024\], got 0"),
        ({"num_hidden_layers": -1}, r"num_hidden_layers must be an integer in \[1, 1024\], got -1"),
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers must be an integer in \[1, 1024\], got 10{12}"),
        ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer .* got True"),  # True == 1
        ({"num_hidden_layers": 2.0}, r"num_hidden_layers must be an integer .* got 2\.0"),
        ({"hidden_size": 1 << 40}, r"hidden_size must be an integer in \[1, 131072\]"),
        ({"vocab_size": 1 << 40}, r"vocab_size must be an integer in \[1, 4194304\]"),
        (
            {"max_position_embeddings": 1 << 50},
            r"max_position_embeddings must be an integer in \[1, 16777216\]",
        ),
        ({"num_key_value_heads": 0}, r"num_key_value_heads must be an integer in \[1, 1024\], got 0"),
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        (
            {"head_dim": None, "hidden_size": 66},
            r"hidden_size \(66\) is not a multiple of num_attention_heads",
        ),
        ({"rope_theta": 0}, r"rope_theta must be a number in \(0, 1e\+12\], got 0"),
        ({"rope_theta": -1e4}, r"rope_theta must be a number in \(0, 1e\+12\], got -10000\.0"),
        ({"rope_theta": NAN}, r"rope_theta must be a number in \(0, 1e\+12\], got nan"),
        ({"rope_theta": INF}, r"rope_theta must be a number .* got inf"),
        ({"rope_theta": "1e6"}, r"rope_theta must be a number .* got '1e6'"),
        ({"rms_norm_eps": NAN}, r"rms_norm_eps must be a number in \(0, 1\], got nan"),
        ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be a number in \(0, 1\], got -1e-06"),
        ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
        ({"attention_bias": 1}, r"attention_bias must be true or false, got 1"),
        ({"eos_token_id": 1024}, r"eos_token_id must be an integer in \[0, 1023\], got 1024"),
        ({"eos_token_id": -1}, r"eos_token_id must be an integer in \[0, 1023\], got -1"),
        ({"eos_token_id": ["</s>"]}, r"eos_token_id must be an integer in \[0, 1023\], got '</s>'"),
        ({"rope_parameters": [1, 2]}, r"rope_parameters must be an object, got list"),
        (
            {"rope_scaling": LLAMA3_ROPE | {"factor": 0}},
            r"rope_scaling\.factor must be a number in \(0, 1024\]",
        ),
        (
            {"rope_scaling": LLAMA3_ROPE | {"high_freq_factor": 1.0}},
            r"high_freq_factor \(1\.0\) must exceed low_freq_factor \(1\.0\)",
        ),
        (
            {"rope_scaling": LLAMA3_ROPE | {"original_max_position_embeddings": 0}},
            r"rope_scaling\.original_max_position_embeddings must be an integer in \[1, 16777216\], got 0",
        ),
    ],
)
def test_a_value_out_of_its_range_or_type_is_refused_naming_the_key_and_the_limit(
    changes: dict, message: str
) -> None:
    """Each of these was accepted: a trillion layers hung the build, NaN RoPE or norms served noise,
    "false" tied the head, True meant one layer, an EOS id past the vocabulary never stopped."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(QWEN3 | changes, None, torch.float32)


def test_an_eos_id_from_generation_config_is_named_by_its_file() -> None:
    with pytest.raises(ValueError, match=r"generation_config.json's eos_token_id must be .* got 10{30}"):
        ModelConfig.from_hf(QWEN3, {"eos_token_id": 10**30}, torch.float32)


QWEN2 = QWEN3 | {"architectures": ["Qwen2ForCausalLM"]}
MISTRAL = QWEN3 | {"architectures": ["MistralForCausalLM"], "tie_word_embeddings": False}


@pytest.mark.parametrize(
    ("hf_config", "biases"),
    [
        (QWEN3 | {"architectures": ["LlamaForCausalLM"], "attention_bias": True}, (True, True)),
        (QWEN3 | {"attention_bias": True}, (True, True)),
        (QWEN2, (True, False)),  # transformers' Qwen2Attention: bias=True on q/k/v, False on o_proj
        (QWEN2 | {"attention_bias": False}, (True, False)),  # a key Qwen2 does not read
        (MISTRAL | {"attention_bias": True}, (False, False)),  # nor does Mistral
    ],
)
def test_each_family_biases_the_projections_transformers_builds_with_a_bias(
    hf_config: dict, biases: tuple[bool, bool]
) -> None:
    config = ModelConfig.from_hf(hf_config, None, torch.float32)
    assert (config.qkv_bias, config.o_bias) == biases


@pytest.mark.parametrize(
    ("hf_config", "window"),
    [
        (MISTRAL | {"sliding_window": None}, None),  # v0.3
        (MISTRAL, None),  # no key at all: no window
        (MISTRAL | {"sliding_window": 4096}, (4096, "sliding_window 4096")),  # v0.1
        (QWEN2 | {"use_sliding_window": False, "sliding_window": 4096}, None),  # every released Qwen2
        (
            QWEN2 | {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
            (64, "use_sliding_window true, sliding_window 64 (from layer max_window_layers 1 on, of 2)"),
        ),
        # max_window_layers past the last layer: transformers makes no layer slide.
        (QWEN2 | {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 28}, None),
        (
            QWEN3 | {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]},
            (
                4096,
                "use_sliding_window true, sliding_window 4096 "
                "(layer_types marks 1 of 2 layers sliding_attention)",
            ),
        ),
        (QWEN2 | {"use_sliding_window": True, "sliding_window": None}, None),
        (  # what transformers 5 saves: layer_types, written when the window was off, says none slides
            QWEN2 | {"use_sliding_window": True, "layer_types": ["full_attention", "full_attention"]},
            None,
        ),
        (QWEN3 | {"architectures": ["LlamaForCausalLM"], "sliding_window": 16}, None),  # not Llama's key
    ],
)
def test_a_sliding_window_is_read_where_transformers_applies_one(
    hf_config: dict, window: tuple[int, str] | None
) -> None:
    config = ModelConfig.from_hf(hf_config, None, torch.float32)
    said = config.sliding_window
    assert (None if said is None else (said.size, said.said)) == window


@pytest.mark.parametrize(
    ("hf_config", "message"),
    [
        (MISTRAL | {"sliding_window": 0}, r"sliding_window must be null or a positive integer, got 0"),
        (MISTRAL | {"sliding_window": "4096"}, r"sliding_window must be null .* got '4096'"),
        (
            QWEN2 | {"use_sliding_window": "true"},
            r"use_sliding_window must be true or false, got 'true'",
        ),
        (
            QWEN2 | {"use_sliding_window": True, "layer_types": ["sliding_attention"]},
            r"layer_types must be a list of 2 layer kinds",
        ),
    ],
)
def test_a_sliding_window_of_the_wrong_type_is_refused_naming_the_key(hf_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf_config, None, torch.float32)


def test_the_config_says_qk_norm_where_the_model_class_builds_it() -> None:
    # An adapter's names are checked below the model classes, from the config: the two must agree.
    for architecture, model_class in MODEL_CLASSES.items():
        config = ModelConfig.from_hf(QWEN3 | {"architectures": [architecture]}, None, torch.float32)
        assert config.has_qk_norm == model_class.use_qk_norm, architecture
