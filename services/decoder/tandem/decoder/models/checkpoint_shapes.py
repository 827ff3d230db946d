"""A checkpoint's weights against its config.json, from the safetensors headers alone.

A config that disagrees with its weights (num_attention_heads 5 beside a q_proj of 9 heads' rows, a
vocab_size that is not embed_tokens' row count, an intermediate_size that is not gate_proj's) was
refused only by the load, once the model was built and each weight read: after the server listened,
exit 1. Every shape the model will read is implied by the config alone (common/weight_shapes.py), and
the loader has parsed every header before listening, so the two are compared there, reading no tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.common.vision_language import WeightLayout
from tandem.common.weight_shapes import TextModelShape, expected_weights, mismatch
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.registry import MODEL_CLASSES


def text_model_shape(config: ModelConfig) -> TextModelShape:
    """What sizes the weights of the model `config` builds (MODEL_CLASSES[config.architecture])."""
    return TextModelShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        has_qk_norm=MODEL_CLASSES[config.architecture].use_qk_norm,
        is_tied=config.tie_word_embeddings,
        has_qkv_bias=config.qkv_bias,
        has_o_bias=config.o_bias,
        has_mlp_bias=config.mlp_bias,
    )


def check_shapes(
    file_of: dict[str, Any],  # checkpoint name -> the open safetensors file holding it
    path_of: dict[str, Path],  # checkpoint name -> that file's path
    layout: WeightLayout,  # where the language model's weights sit (a vision-language prefix)
    config: ModelConfig,
    model_dir: Path,
) -> str | None:
    """The refusal of the first weight the model reads that the files lack, or hold in another shape
    than config.json implies; None when all agree. get_slice reads a header's shape, no data."""
    for name, expected in expected_weights(text_model_shape(config)).items():
        key = layout.checkpoint_name(name)
        if key not in file_of:
            return f"weight {key} not found in the checkpoint in {model_dir}"
        refusal = mismatch(key, tuple(file_of[key].get_slice(key).get_shape()), expected, "config.json")
        if refusal is not None:
            return f"{path_of[key]}: {refusal}"
    return None
