"""Loads a Hugging Face checkpoint directory into a decoder model and its tokenizer.

The model is built on the meta device, so no memory is allocated until each weight is read
(safetensors_weights.py) and assigned in place of the meta tensor: every weight exists once, in its
final dtype. config.json is read by checkpoint_config.py, tokenizer.json and the chat template's files
checked by tokenizer_files.py. Quantized weights are cut from the one-rank model's
(quantized_shards.py): a rank reads a projection cut by its inputs (and under gguf every quantized
tensor) whole, one at a time, and keeps its cut.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tandem.common import vision_language
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.torch_part.quantized_tensor import BLOCK, SCHEMES, QuantizedTensor
from tandem.decoder.models import quantized
from tandem.decoder.models.checkpoint_config import read_architecture, read_config
from tandem.decoder.models.checkpoint_shapes import check_unread
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.gguf_weights import read_quantized
from tandem.decoder.models.model_load_error import ModelLoadError
from tandem.decoder.models.quantized_shards import check_cuttable
from tandem.decoder.models.registry import MODEL_CLASSES
from tandem.decoder.models.safetensors_weights import index_weights, open_weights, read_part, read_weights
from tandem.decoder.models.tensor_parallel import CheckpointPart, ParallelGroup, check_shardable
from tandem.decoder.models.tokenizer_files import check_chat_template, read_tokenizer
from tandem.decoder.models.transformer import DecoderModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderModel  # eval mode, no grad, on the requested device and dtype
    tokenizer: Tokenizer
    config: ModelConfig  # config.eos_token_ids are the generation EOS ids


def check_checkpoint(model_dir: str | Path, dtype: str = "bfloat16") -> ModelConfig:
    """Everything `load_model` checks before it reads a weight: the dtype, config.json and its
    architecture, the tokenizer against the vocabulary, that the weight files are there, each of the
    shape config.json implies and stored in a type a weight is read from, and none the model would read
    under another config.json.

    Cheap (no weight is read, but a separate head beside tie_word_embeddings true, compared with the
    token table), so a service runs it before it listens; it logs the warnings on weights the model
    does not read (checkpoint_shapes.check_unread). Raises ModelLoadError.
    """
    config, _, _, warnings = _checked(Path(model_dir), dtype)
    for warning in warnings:  # here alone: load_model, on each rank, runs the same checks again
        log.warning("%s", warning)
    return config


def read_model_config(model_dir: str | Path, dtype: str = "bfloat16") -> ModelConfig:
    """The model config from config.json (and generation_config.json) alone, neither the tokenizer nor
    a weight's header read: what an engine on XLA sizes its KV pool by before the load. Raises
    ModelLoadError."""
    return read_config(Path(model_dir), dtype)[0]


def _checked(model_dir: Path, dtype: str) -> tuple[ModelConfig, str, Tokenizer, list[str]]:
    """The config, its architecture, the tokenizer and the warnings on weights the model does not read
    (checkpoint_shapes.check_unread), once everything but the weights' values checked out."""
    if dtype not in COMPUTE_NAMES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (supported: {', '.join(COMPUTE_NAMES)})")
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config, architecture, is_vision_language = read_config(model_dir, dtype)
    tokenizer = read_tokenizer(model_dir, config, is_vision_language)  # before the weights: fails fast
    check_chat_template(model_dir)
    with ExitStack() as stack:  # the headers only, and a tied head's values where the file has one
        file_of, path_of, stamp_of, layout = index_weights(stack, model_dir, config)
        warnings = check_unread(file_of, path_of, stamp_of, layout, config, ModelLoadError)
    return config, architecture, tokenizer, warnings


def load_model(
    model_dir: str | Path,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    tp: ParallelGroup | None = None,
    quantization: str = "none",
    quantized_from: str | Path | None = None,
    group_size: int = BLOCK,
) -> LoadedModel:
    """Reads config, generation config, tokenizer and weights from a checkpoint directory.

    `dtype` is one of COMPUTE_NAMES; weights are cast to it whatever the file stores. With `tp`, the model is
    this rank's shard. Weights come back unpacked; the engine packs them where its backend says to.
    `quantization` (EngineConfig's): "gguf" serves the linears and the token table as `quantized_from`
    (the GGUF file model_dir was imported from) stores them (models/gguf_weights.py); "int8" and
    "int4" round them from the loaded weights (int4: one scale per `group_size` inputs); either way
    the dense weights are released, and with `tp` each rank holds its cut of the one-rank model's.
    Every few seconds of reading, a progress line is logged. Raises ModelLoadError.
    """
    model_dir = Path(model_dir)
    config, architecture, tokenizer, _ = _checked(model_dir, dtype)
    if tp is not None:
        try:
            check_shardable(config, tp.world_size)
            if quantization != "none":
                check_cuttable(config, tp.world_size)
        except ValueError as e:
            raise ModelLoadError(f"config.json in {model_dir}: {e}") from e
    with torch.device("meta"):
        model = MODEL_CLASSES[architecture](config, tp)
    # Quantized weights are rounded on the host whatever the device (an XLA device then holds the very
    # codes the CPU engine serves), and moved after.
    read_to = torch.device("cpu") if quantization != "none" else torch.device(device)
    model.load_state_dict(read_weights(model, model_dir, config.dtype, read_to), assign=True)
    model.train(False).requires_grad_(False)  # inference mode
    if quantization != "none":
        quantized.apply(model, _quantized_weights(model, model_dir, quantization, quantized_from, group_size))
    model.to(device)  # moves the non-persistent buffers (RoPE frequencies) built on the host
    if quantization != "none":
        quantized.move(model, torch.device(device))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config)


def _quantized_weights(
    model: DecoderModel,
    model_dir: Path,
    quantization: str,
    quantized_from: str | Path | None,
    group_size: int,
) -> dict[str, QuantizedTensor]:
    if quantization == "gguf":
        if quantized_from is None:
            raise ModelLoadError("--quantization gguf needs the GGUF file the checkpoint was imported from")
        try:
            return read_quantized(Path(quantized_from), model)
        except ValueError as e:  # QuantizationError, or a tensor of another shape than config.json's
            raise ModelLoadError(str(e)) from None
    if quantization not in SCHEMES:
        raise ModelLoadError(
            f"--quantization must be none, gguf or one of {tuple(SCHEMES)}, got {quantization!r}"
        )
    with ExitStack() as stack:
        read_whole = None if model.tp is None else _whole_reader(stack, model, model_dir)
        try:
            return quantized.rounded(model, quantization, group_size, read_whole)
        except ModelLoadError:
            raise
        except ValueError as e:  # a group size that does not divide a row
            raise ModelLoadError(f"--quantization-group-size {group_size}: {e}") from None


def _whole_reader(
    stack: ExitStack, model: DecoderModel, model_dir: Path
) -> Callable[[CheckpointPart], torch.Tensor]:
    """Reads a checkpoint tensor whole, in the model's dtype, whatever shard of it this rank holds:
    a weight cut by its inputs is rounded whole, then cut (quantized_shards.py)."""
    file_of = open_weights(stack, model_dir, model.config)
    layout = vision_language.weight_layout(read_architecture(model_dir), file_of, ModelLoadError)

    def read_whole(part: CheckpointPart) -> torch.Tensor:
        key = layout.checkpoint_name(part.name)
        whole = dataclasses.replace(part, shard_dim=None)
        return read_part(file_of[key], whole, key, model).to(model.config.dtype)

    return read_whole
