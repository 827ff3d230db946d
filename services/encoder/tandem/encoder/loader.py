"""Builds the configured embedder. Raises EmbedderLoadError naming the file at fault.

The lookup embedder on a vision-language checkpoint (LLaVA, SmolVLM) is its image half as well: the
token table for text, and the vision tower and projector for images (`vision/embedder.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tandem.common import vision_language
from tandem.encoder.config import EncoderConfig
from tandem.encoder.embedder import Embedder, EmbedderLoadError
from tandem.encoder.lookup import LookupEmbedder, check_architectures, read_json
from tandem.encoder.projector import ProjectorEmbedder
from tandem.encoder.soft_prompt import SoftPromptEmbedder


def load_embedder(config: EncoderConfig, tokenizer: Tokenizer | None = None) -> Embedder:
    """`tokenizer`: --model's tokenizer.json, already parsed (the __main__ parses it before listening),
    for the embedders that read it; else each reads it itself."""
    dtype = config.torch_dtype
    if config.embedder == "soft-prompt":
        assert config.adapter_dir is not None  # guaranteed by EncoderConfig's validation
        return SoftPromptEmbedder.load(
            config.model_dir, config.adapter_dir, dtype, config.quantization, tokenizer
        )
    if config.embedder == "projector":
        assert config.encoder_model_dir is not None and config.projector_path is not None
        return ProjectorEmbedder.load(
            config.model_dir, config.encoder_model_dir, config.projector_path, dtype
        )
    hf_config = check_architecture(config.model_dir)
    if vision_language.is_vision_language(hf_config):
        from tandem.encoder.vision.embedder import VisionLanguageEmbedder

        return VisionLanguageEmbedder.load(config.model_dir, dtype, config.quantization, tokenizer)
    return LookupEmbedder.load(config.model_dir, dtype, config.quantization, tokenizer)


def check_architecture(model_dir: Path) -> dict[str, Any]:
    """config.json of the checkpoint in `model_dir` ({} where there is none), refused where it has a
    vision tower of an architecture whose image half is not served: the __main__ runs it before
    listening for the lookup embedder. Raises EmbedderLoadError."""
    config_path = model_dir / "config.json"
    hf_config = read_json(config_path) if config_path.is_file() else {}
    check_architectures(hf_config, model_dir)
    if "vision_config" in hf_config and not vision_language.is_vision_language(hf_config):
        architecture = (hf_config.get("architectures") or ["?"])[0]
        raise EmbedderLoadError(
            f"config.json: vision-language architecture {architecture!r} is not supported "
            f"(supported: {', '.join(vision_language.ARCHITECTURES)})"
        )
    return hf_config
