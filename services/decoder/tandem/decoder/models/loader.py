"""Loads a Hugging Face checkpoint directory into a decoder model and its tokenizer.

The model is built on the meta device, so no memory is allocated until each weight is read from
safetensors (memory-mapped), checked against the shape the model expects, cast, moved to the device
and assigned in place of the meta tensor: every weight exists once, in its final dtype. Pickle-based
files (`*.bin`, `torch.load`) are never read. With a ParallelGroup each rank reads only its shard of
each tensor (safetensors `get_slice`), so no rank ever holds the whole model. Quantized weights are
cut from the one-rank model's (quantized_shards.py): a rank reads a projection cut by its inputs (and
under gguf every quantized tensor) whole, one at a time, and keeps its cut.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from tandem.common import vision_language
from tandem.common.checkpoint import read_json
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.quantization_config import quantization_refusal
from tandem.common.torch_part.quantized_tensor import BLOCK, SCHEMES, QuantizedTensor
from tandem.common.torch_part.torch_dtypes import COMPUTE_DTYPES
from tandem.common.torch_part.weight_files import index_files
from tandem.common.wire_limits import MAX_TEMPLATE_CHARS
from tandem.decoder.models import quantized
from tandem.decoder.models.checkpoint_shapes import FileStamp, check_shapes, check_unread
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.gguf_weights import read_quantized
from tandem.decoder.models.quantized_shards import check_cuttable
from tandem.decoder.models.registry import MODEL_CLASSES
from tandem.decoder.models.tensor_parallel import CheckpointPart, ParallelGroup, check_shardable
from tandem.decoder.models.transformer import DecoderModel

log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file or weight at fault."""


MAX_TOKENIZER_BYTES = 256 << 20  # the largest in use are about 35 MB (Gemma 3's 262K entries)

# What serves in place of a checkpoint quantized for another loader, in the decoder's own flags.
QUANTIZED_ELSEWHERE = (
    "Serve the bf16, fp16 or fp32 checkpoint it was quantized from, with --quantization int8 or int4 to "
    "quantize at load, or a GGUF file with --quantization gguf (docs/DEPLOYMENT.md)"
)


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
    return _read_config(Path(model_dir), dtype)[0]


def _checked(model_dir: Path, dtype: str) -> tuple[ModelConfig, str, Tokenizer, list[str]]:
    """The config, its architecture, the tokenizer and the warnings on weights the model does not read
    (checkpoint_shapes.check_unread), once everything but the weights' values checked out."""
    if dtype not in COMPUTE_NAMES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (supported: {', '.join(COMPUTE_NAMES)})")
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config, architecture, is_vision_language = _read_config(model_dir, dtype)
    tokenizer = _read_tokenizer(model_dir, config, is_vision_language)  # before the weights: fails fast
    _check_chat_template(model_dir)
    with ExitStack() as stack:  # the headers only, and a tied head's values where the file has one
        file_of, path_of, stamp_of, layout = _index_weights(stack, model_dir, config)
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
    model.load_state_dict(_read_weights(model, model_dir, config.dtype, read_to), assign=True)
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
    file_of = _open_weights(stack, model_dir, model.config)
    layout = vision_language.weight_layout(_architecture(model_dir), file_of, ModelLoadError)

    def read_whole(part: CheckpointPart) -> torch.Tensor:
        key = layout.checkpoint_name(part.name)
        whole = dataclasses.replace(part, shard_dim=None)
        return _read_part(file_of[key], whole, key, model).to(model.config.dtype)

    return read_whole


def _read_config(model_dir: Path, dtype: str) -> tuple[ModelConfig, str, bool]:
    """The model config (EOS ids from generation_config.json when present), its architecture and whether
    config.json is a vision-language checkpoint's, of which the model config is text_config's."""
    hf_config = _read_json(model_dir / "config.json")
    generation_path = model_dir / "generation_config.json"
    generation_config = _read_json(generation_path) if generation_path.is_file() else None
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


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path, ModelLoadError)


def _read_tokenizer(model_dir: Path, config: ModelConfig, is_vision_language: bool) -> Tokenizer:
    """tokenizer.json, every token of which has a row of the table of `config.vocab_size` (a
    vision-language checkpoint's text_config's). Raises ModelLoadError naming both files."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"tokenizer.json not found in {model_dir}")
    if (size := path.stat().st_size) > MAX_TOKENIZER_BYTES:  # parsed, it takes more than its size
        raise ModelLoadError(f"{path} has {size:,} bytes, more than the limit of {MAX_TOKENIZER_BYTES:,}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise ModelLoadError(f"tokenizer.json in {model_dir} cannot be read: {e}") from None
    stated = vision_language.stated_vocab_size(model_dir, config.vocab_size, is_vision_language)
    if (num_tokens := tokenizer.get_vocab_size(with_added_tokens=True)) > config.vocab_size:
        raise ModelLoadError(f"{path} has {num_tokens} tokens, more than {stated}")
    # A count within the vocabulary may still hold an id past it (ids need not be dense): a text
    # holding that token would index the embedding table past its end.
    token, token_id = max(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    if token_id >= config.vocab_size:
        raise ModelLoadError(f"{path} maps {token!r} to id {token_id}, past {stated}")
    return tokenizer


def _check_chat_template(model_dir: Path) -> None:
    """The files the chat template comes from (engine/admission/chat.py reads them once the weights
    are in) are what it expects, so a broken one is named before the server listens: a malformed
    tokenizer_config.json ended the start-up with json's message naming no file, a chat_template of
    numbers with an AttributeError traceback, a chat_template.jinja not in UTF-8 with the codec's. So
    did a malformed special_tokens_map.json, where the template's special-token names are read from it
    (template_source.read_special_tokens: a config without added_tokens_decoder)."""
    config_path = model_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if "added_tokens_decoder" not in config and (model_dir / "special_tokens_map.json").is_file():
        _read_json(model_dir / "special_tokens_map.json")
    template = config.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template
    )
    if template is not None and not isinstance(template, str) and not named:
        raise ModelLoadError(
            f"{config_path}: chat_template must be a string or a list of {{name, template}} objects"
        )
    if (model_dir / "chat_template.json").is_file():
        _read_json(model_dir / "chat_template.json")
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        if (size := jinja_path.stat().st_size) > 4 * MAX_TEMPLATE_CHARS:  # UTF-8: 4 bytes a character at most
            raise ModelLoadError(
                f"{jinja_path} has {size:,} bytes, more than {MAX_TEMPLATE_CHARS:,} characters take"
            )
        try:
            text = jinja_path.read_text()
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{jinja_path} is not UTF-8 text: {e}") from None
        if len(text) > MAX_TEMPLATE_CHARS:
            raise ModelLoadError(
                f"{jinja_path} has {len(text):,} characters, more than {MAX_TEMPLATE_CHARS:,}"
            )


def _weight_files(model_dir: Path) -> list[Path]:
    shards = index_files(model_dir, ModelLoadError)
    if shards is not None:
        files = sorted(set(shards.values()))
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise ModelLoadError(f"model.safetensors (or model.safetensors.index.json) not found in {model_dir}")
    for path in files:
        if not path.is_file():
            raise ModelLoadError(
                f"{path.name}, listed in model.safetensors.index.json, not found in {model_dir}"
            )
    return files


def _open_weights(stack: ExitStack, model_dir: Path, config: ModelConfig) -> dict[str, Any]:
    """Each weight name -> the open safetensors file that holds it (_index_weights)."""
    file_of, _, _, _ = _index_weights(stack, model_dir, config)
    return file_of


def _index_weights(
    stack: ExitStack, model_dir: Path, config: ModelConfig
) -> tuple[dict[str, Any], dict[str, Path], dict[Path, FileStamp], vision_language.WeightLayout]:
    """Each weight name -> the open safetensors file that holds it, and -> that file's path, each path
    -> its stamp read just before it was opened, and where the language model's weights sit; once
    every file's header parsed (safetensors checks its length, JSON, dtypes and that offsets tile the
    file), no name is in two files or belongs to a layer past config.json's num_hidden_layers (a
    config that does not match its weights, which would otherwise serve the first layers alone), and
    every shape is config.json's, every type one a weight is read from. Only headers are read."""
    file_of: dict[str, Any] = {}
    path_of: dict[str, Path] = {}
    stamp_of: dict[Path, FileStamp] = {}
    for path in _weight_files(model_dir):
        try:
            stamp_of[path] = FileStamp.of(path)  # before the open: what was opened is this stamp's, or newer
            # The file the stamp resolved, not `path`: a symlink (Hugging Face's cache holds them)
            # retargeted before the open and back after it would have another file judged by its verdict.
            handle = stack.enter_context(safe_open(stamp_of[path].path, framework="pt", device="cpu"))
        except (SafetensorError, OSError) as e:  # SafetensorError is a bare Exception
            raise ModelLoadError(f"{path} is not a readable safetensors file: {e}") from None
        for key in handle.keys():
            if key in path_of:
                raise ModelLoadError(
                    f"weight {key} is in both {path_of[key].name} and {path.name} in {model_dir}"
                )
            file_of[key], path_of[key] = handle, path
    layout = vision_language.weight_layout(_architecture(model_dir), file_of, ModelLoadError)
    layer = re.compile(re.escape(layout.model_prefix) + r"layers\.(\d+)\.")
    for key, path in path_of.items():
        match = layer.match(key)
        if match and int(match.group(1)) >= config.num_layers:
            raise ModelLoadError(
                f"{path}: weight {key} is of layer {match.group(1)}, but config.json's num_hidden_layers "
                f"is {config.num_layers}"
            )
    if (refusal := check_shapes(file_of, path_of, layout, config, model_dir)) is not None:
        raise ModelLoadError(refusal)
    return file_of, path_of, stamp_of, layout


def _read_weights(
    model: DecoderModel, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every parameter of `model`, read from the checkpoint, shape-checked, fused, cast and moved."""
    state: dict[str, torch.Tensor] = {}
    progress = _Progress(len(list(model.parameters())))
    with ExitStack() as stack:
        file_of = _open_weights(stack, model_dir, model.config)
        layout = vision_language.weight_layout(_architecture(model_dir), file_of, ModelLoadError)
        for name, _ in model.named_parameters():
            parts, keys = [], []
            for part in model.checkpoint_parts(name):
                key = layout.checkpoint_name(part.name)
                if key not in file_of:
                    raise ModelLoadError(f"weight {key} not found in the checkpoint in {model_dir}")
                parts.append(_read_part(file_of[key], part, key, model))
                keys.append(key)
            fused = parts[0] if len(parts) == 1 else torch.cat(parts)
            state[name] = fused.to(device=device, dtype=dtype)
            # On an XLA device each check would compile and run a graph: there it runs on the host.
            on_device = device.type in ("cpu", "cuda")
            _check_finite(state[name] if on_device else fused.to(dtype), fused, keys, [len(p) for p in parts])
            progress.add(state[name])
    progress.done()
    return state


PROGRESS_INTERVAL_S = 5.0  # a large checkpoint reports how far it got at most this often


class _Progress:
    """Log lines while weights load: one every PROGRESS_INTERVAL_S, and one when all are in."""

    def __init__(self, num_weights: int) -> None:
        self.num_weights = num_weights
        self.num_done = 0
        self.num_bytes = 0
        self.start = self.last = time.monotonic()

    def add(self, weight: torch.Tensor) -> None:
        self.num_done += 1
        self.num_bytes += weight.numel() * weight.element_size()
        now = time.monotonic()
        if now - self.last >= PROGRESS_INTERVAL_S and self.num_done < self.num_weights:
            self.last = now
            log.info(
                "loading weights: %d/%d (%.0f%%, %.2f GB, %.0f s)",
                self.num_done,
                self.num_weights,
                100 * self.num_done / self.num_weights,
                self.num_bytes / 1e9,
                now - self.start,
            )

    def done(self) -> None:
        log.info(
            "loaded %d weights (%.2f GB) in %.1f s",
            self.num_done,
            self.num_bytes / 1e9,
            time.monotonic() - self.start,
        )


def _architecture(model_dir: Path) -> str:
    """config.json's own architecture (a vision-language one for a LLaVA or SmolVLM directory)."""
    return (_read_json(model_dir / "config.json").get("architectures") or [""])[0]


def _read_part(handle: Any, part: CheckpointPart, key: str, model: DecoderModel) -> torch.Tensor:
    """Checkpoint tensor `key`, shape-checked, or only this rank's slice of it along part.shard_dim. Its
    type was checked with the headers (checkpoint_shapes.check_shapes)."""
    lazy = handle.get_slice(key)  # memory-mapped: nothing is read until indexed
    shape = tuple(lazy.get_shape())
    if shape != part.shape:
        raise ModelLoadError(f"weight {key} has shape {list(shape)}, expected {list(part.shape)}")
    tp = model.tp
    if tp is None or part.shard_dim is None:
        return handle.get_tensor(key)
    size = shape[part.shard_dim] // tp.world_size
    window = (slice(None),) * part.shard_dim + (slice(tp.rank * size, (tp.rank + 1) * size),)
    # The window is a view of the whole tensor as read (a window of columns, o_proj's and down_proj's
    # cut by inputs, a strided one): kept where the model's dtype is the file's, each rank held the
    # whole weight (the token table too), and the C kernel refused the strided ones, so those linears
    # ran on F.linear, whose sums follow the row count (3 ranks: a decode row beside a prompt chunk
    # got other bits). A copy of its own.
    return lazy[window].clone(memory_format=torch.contiguous_format)


def _check_finite(weight: torch.Tensor, read: torch.Tensor, keys: list[str], num_rows: list[int]) -> None:
    """Refuses a weight with a NaN or an infinity, in the file or once cast (3e38 is finite in float32
    and inf in float16), naming the checkpoint tensor and the first such element. Served, one such
    value can turn every logit to NaN, and every request then ends INTERNAL (the sampler's
    non-finite check) from a server that reported itself ready; vLLM loads them regardless.
    `weight` is `read` (the `keys` tensors, `num_rows` rows each, stacked) cast to the model's dtype."""
    low, high = torch.aminmax(weight)  # NaN propagates: one pass, 10-20x faster than isfinite().all()
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return
    index = [int(i) for i in (~torch.isfinite(weight)).nonzero()[0]]
    value, stored = weight[tuple(index)].item(), read[tuple(index)].item()
    part = 0
    while index[0] >= num_rows[part]:  # rows of a fused weight back to its checkpoint tensor's
        index[0] -= num_rows[part]
        part += 1
    cast = f" ({stored:g} in the file)" if math.isfinite(stored) else ""
    raise ModelLoadError(f"weight {keys[part]} holds {value} at {index} in {weight.dtype}{cast}")
