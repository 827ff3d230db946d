"""A checkpoint directory's safetensors weights: indexed from their headers, then read into a model's
parameters.

Each weight is read from safetensors (memory-mapped), checked against the shape the model expects and
for values that are not finite, fused, cast and moved to the device. Pickle-based files (`*.bin`,
`torch.load`) are never read. With a ParallelGroup each rank reads only its shard of each tensor
(safetensors `get_slice`), so no rank ever holds the whole model.
"""

from __future__ import annotations

import logging
import math
import re
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tandem.common import vision_language
from tandem.common.torch_part.weight_files import index_files
from tandem.decoder.models.checkpoint_config import read_architecture
from tandem.decoder.models.checkpoint_shapes import FileStamp, check_shapes
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.model_load_error import ModelLoadError
from tandem.decoder.models.tensor_parallel import CheckpointPart
from tandem.decoder.models.transformer import DecoderModel

log = logging.getLogger(__name__)


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


def open_weights(stack: ExitStack, model_dir: Path, config: ModelConfig) -> dict[str, Any]:
    """Each weight name -> the open safetensors file that holds it (index_weights)."""
    file_of, _, _, _ = index_weights(stack, model_dir, config)
    return file_of


def index_weights(
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
    layout = vision_language.weight_layout(read_architecture(model_dir), file_of, ModelLoadError)
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


def read_weights(
    model: DecoderModel, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every parameter of `model`, read from the checkpoint, shape-checked, fused, cast and moved."""
    state: dict[str, torch.Tensor] = {}
    progress = _Progress(len(list(model.parameters())))
    with ExitStack() as stack:
        file_of = open_weights(stack, model_dir, model.config)
        layout = vision_language.weight_layout(read_architecture(model_dir), file_of, ModelLoadError)
        for name, _ in model.named_parameters():
            parts, keys = [], []
            for part in model.checkpoint_parts(name):
                key = layout.checkpoint_name(part.name)
                if key not in file_of:
                    raise ModelLoadError(f"weight {key} not found in the checkpoint in {model_dir}")
                parts.append(read_part(file_of[key], part, key, model))
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


def read_part(handle: Any, part: CheckpointPart, key: str, model: DecoderModel) -> torch.Tensor:
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
