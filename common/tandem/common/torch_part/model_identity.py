"""Which model a checkpoint is, as far as its embeddings go: what a decoder and its encoder compare.

Both services load one checkpoint each (`--model`), and an encoder's rows are only right for a decoder
of the same model: another model of the same hidden size and dtype takes them without complaint and
answers from the wrong space. Names cannot tell (`--model-name` is free, directories get renamed or
copied), nor can config.json (two fine-tunes of one base share it). The token table can: a sample of
it, NUM_ROWS rows by NUM_COLUMNS columns at positions fixed by its shape, read from the files as stored
(a few rows, whatever the checkpoint's size).

The samples are compared within a tolerance (`tandem.common.token_table_sample`, apart so that the
gateway compares its decoder replicas' samples without torch). Rounding at load (--quantization int8,
int4, gguf) never touches the files, so a quantized decoder and its encoder compare the same sample. A
checkpoint that differs from another only after its token table (a fine-tune that froze it) shares its
sample, and its lookup rows are indeed the same: the gateway, which must tell such a tune from its base
across decoder replicas, also compares samples of later weights (`read_weight_samples`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tandem.common.checkpoint import read_json
from tandem.common.token_table_sample import TableSample
from tandem.common.torch_part.weight_files import weight_names
from tandem.common.vision_language import weight_layout
from tandem.common.weight_sample import WeightSample

NUM_ROWS = 16
NUM_COLUMNS = 8
TABLE_NAME = "model.embed_tokens.weight"  # a causal LM's name; a vision-language one's via its layout


def sample_positions(vocab_size: int, hidden_size: int) -> tuple[list[int], list[int]]:
    """Rows and columns spread evenly over the table, the first and last of each left out (a padding
    or special token's row is often zeros)."""
    rows = [(2 * i + 1) * vocab_size // (2 * NUM_ROWS) for i in range(NUM_ROWS)]
    columns = [(2 * j + 1) * hidden_size // (2 * NUM_COLUMNS) for j in range(NUM_COLUMNS)]
    return rows, columns


def read_table_sample(model_dir: Path, error: Callable[[str], Exception]) -> TableSample:
    """The token table's sample, read from the checkpoint in `model_dir` (model.safetensors, or the
    shard its index names). Raises `error` naming what is missing."""
    hf_config = read_json(model_dir / "config.json", error)
    architecture = (hf_config.get("architectures") or [""])[0]
    files = weight_names(model_dir, error)
    name = weight_layout(architecture, files, error).checkpoint_name(TABLE_NAME)
    if name not in files:
        raise error(f"{name} not found in {model_dir}")
    with safe_open(files[name], framework="pt", device="cpu") as weights:
        table = weights.get_slice(name)  # read row by row below: nothing else is mapped in
        shape = table.get_shape()
        if len(shape) != 2 or min(shape) < 1:
            raise error(f"{name} in {model_dir} has shape {shape}, not [vocab_size, hidden_size]")
        vocab_size, hidden_size = shape
        values = _sampled_values(table, vocab_size, hidden_size)
    return TableSample(vocab_size, hidden_size, values)


def _sampled_values(tensor: Any, rows: int, columns: int) -> tuple[float, ...]:
    """`tensor`'s (a safetensors slice, [rows, columns]) values at `sample_positions`, row by row, read
    a row at a time: nothing else is mapped in."""
    row_positions, column_positions = sample_positions(rows, columns)
    values = [tensor[row : row + 1].float()[0, column_positions].tolist() for row in row_positions]
    return tuple(v for row in values for v in row)


def read_weight_samples(model_dir: Path, error: Callable[[str], Exception]) -> tuple[WeightSample, ...]:
    """Samples of the weights `tandem.common.weight_sample` says why: the last decoder layer's
    down_proj, the final norm, and lm_head where the checkpoint holds one, each named as a causal LM's
    checkpoint names it (a vision-language layout's own name is only where it is read). A tensor the
    checkpoint does not hold (a mixture of experts has no down_proj of its layer) is not sampled.
    A one-dimensional tensor is one row: its NUM_COLUMNS values. Raises `error` as `read_table_sample`."""
    hf_config = read_json(model_dir / "config.json", error)
    architecture = (hf_config.get("architectures") or [""])[0]
    files = weight_names(model_dir, error)
    layout = weight_layout(architecture, files, error)
    down_proj = re.compile(re.escape(layout.model_prefix) + r"layers\.(\d+)\.mlp\.down_proj\.weight")
    layers = [int(match[1]) for name in files if (match := down_proj.fullmatch(name))]
    # Named as a causal LM's checkpoint names them, whatever the layout: one LLaVA model saved by
    # transformers >= 4.52 ("model.language_model.layers...") and by the Hub's llava-hf
    # ("language_model.model.layers...") shared no name, and a tune in one layout agreed with its base in
    # the other (nothing compared).
    names = [f"model.layers.{max(layers)}.mlp.down_proj.weight"] if layers else []
    names += ["model.norm.weight", "lm_head.weight"]
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)  # (the name reported, the stored one)
    for name in names:
        if (stored := layout.checkpoint_name(name)) in files:
            by_file[files[stored]].append((name, stored))
    samples = {}
    for path, in_file in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as weights:
            for name, stored in in_file:
                tensor = weights.get_slice(stored)
                shape = tensor.get_shape()
                if len(shape) not in (1, 2) or min(shape) < 1:
                    raise error(f"{stored} in {model_dir} has shape {shape}, not one or two dimensions")
                if len(shape) == 1:  # read whole: a norm's hidden_size values
                    values = tensor[:].float()[sample_positions(1, shape[0])[1]].tolist()
                    samples[name] = WeightSample(name, 1, shape[0], tuple(values))
                else:
                    samples[name] = WeightSample(name, *shape, _sampled_values(tensor, *shape))
    return tuple(samples[name] for name in names if name in samples)
