"""The decoder's model config (models/config.py) from the configs checkpoints carry."""

from __future__ import annotations

import torch

from common.tests.common.test_vision_language import LLAVA_15
from tandem.common.vision_language import text_config
from tandem.decoder.models.config import ModelConfig


def test_the_decoder_builds_its_model_config_from_the_text_config() -> None:
    config = ModelConfig.from_hf(text_config(LLAVA_15, ValueError), None, torch.bfloat16)
    assert (config.architecture, config.hidden_size, config.num_layers, config.vocab_size) == (
        "LlamaForCausalLM",
        4096,
        32,
        32064,
    )
    assert config.num_kv_heads == 32 and config.rms_norm_eps == 1e-5
