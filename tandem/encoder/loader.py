"""Builds the configured embedder. Raises EmbedderLoadError naming the file at fault."""

from __future__ import annotations

from tandem.encoder.config import EncoderConfig
from tandem.encoder.embedder import Embedder
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.projector import ProjectorEmbedder
from tandem.encoder.soft_prompt import SoftPromptEmbedder


def load_embedder(config: EncoderConfig) -> Embedder:
    dtype = config.torch_dtype
    if config.embedder == "soft-prompt":
        assert config.adapter_dir is not None  # guaranteed by EncoderConfig's validation
        return SoftPromptEmbedder.load(config.model_dir, config.adapter_dir, dtype, config.quantization)
    if config.embedder == "projector":
        assert config.encoder_model_dir is not None and config.projector_path is not None
        return ProjectorEmbedder.load(
            config.model_dir, config.encoder_model_dir, config.projector_path, dtype
        )
    return LookupEmbedder.load(config.model_dir, dtype, config.quantization)
