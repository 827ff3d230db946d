"""A checkpoint directory's config.json (and generation_config.json) read into a ModelConfig: its
architecture one the decoder serves (a vision-language checkpoint's language model: text_config), and
no quantization_config of another loader's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.common import vision_language
from tandem.common.checkpoint import read_json
from tandem.common.quantization_config import quantization_refusal
from tandem.common.torch_part.torch_dtypes import COMPUTE_DTYPES
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.model_load_error import ModelLoadError
from tandem.decoder.models.registry import MODEL_CLASSES

# What serves in place of a checkpoint quantized for another loader, in the decoder's own flags.
QUANTIZED_ELSEWHERE = (
    "Serve the bf16, fp16 or fp32 checkpoint it was quantized from, with --quantization int8 or int4 to "
    "quantize at load, or a GGUF file with --quantization gguf (docs/DEPLOYMENT.md)"
)


def read_config(model_dir: Path, dtype: str) -> tuple[ModelConfig, str, bool]:
    """The model config (EOS ids from generation_config.json when present), its architecture and whether
    config.json is a vision-language checkpoint's, of which the model config is text_config's."""
    hf_config = read_checkpoint_json(model_dir / "config.json")
    generation_path = model_dir / "generation_config.json"
    generation_config = read_checkpoint_json(generation_path) if generation_path.is_file() else None
    # Before the weights' types: an FP8 checkpoint is named by its method, not by its first e4m3 tensor.
    if (refusal := quantization_refusal(hf_config, QUANTIZED_ELSEWHERE)) is not None:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {refusal}")
    is_vision_language = vision_language.is_vision_language(hf_config)
    if is_vision_language:  # the decoder serves its language model
        hf_config = vision_language.text_config(hf_config, ModelLoadError)
    architectures = hf_config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelLoadError(f"config.json in {model_dir}: architectures must be a list of class names")
    architecture = architectures[0] if architectures else None
    if architecture not in MODEL_CLASSES:
        supported = sorted([*MODEL_CLASSES, *vision_language.ARCHITECTURES])
        raise ModelLoadError(
            f"config.json: architecture {architecture!r} is not supported (supported: {', '.join(supported)})"
        )
    try:
        config = ModelConfig.from_hf(hf_config, generation_config, COMPUTE_DTYPES[dtype])
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"config.json in {model_dir}: {e}") from e
    return config, architecture, is_vision_language


def read_checkpoint_json(path: Path) -> dict[str, Any]:
    return read_json(path, ModelLoadError)


def read_architecture(model_dir: Path) -> str:
    """config.json's own architecture (a vision-language one for a LLaVA or SmolVLM directory)."""
    return (read_checkpoint_json(model_dir / "config.json").get("architectures") or [""])[0]
