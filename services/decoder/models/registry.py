"""Hugging Face architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from services.decoder.models.llama import LlamaForCausalLM
from services.decoder.models.qwen3 import Qwen3ForCausalLM
from services.decoder.models.transformer import DecoderModel

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}
