"""Hugging Face architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from tandem.decoder.models.llama import LlamaForCausalLM
from tandem.decoder.models.mistral import MistralForCausalLM
from tandem.decoder.models.qwen2 import Qwen2ForCausalLM
from tandem.decoder.models.qwen3 import Qwen3ForCausalLM
from tandem.decoder.models.transformer import DecoderModel

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}
