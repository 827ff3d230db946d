"""Which file of a Hugging Face checkpoint holds each weight: model.safetensors, or the shard that
model.safetensors.index.json names. Both services read single weights by name this way (the encoder a
vision tower's, either service a token-table sample) without opening the other shards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from tandem.common.checkpoint import read_json

INDEX_NAME = "model.safetensors.index.json"


def weight_names(model_dir: Path, error: Callable[[str], Exception]) -> dict[str, Path]:
    """Every weight name in the checkpoint in `model_dir` -> the file that holds it. Raises `error`
    naming what is missing or malformed."""
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        weight_map = read_json(index_path, error).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise error(f"{index_path}: weight_map must map weight names to file names")
        return {name: model_dir / file for name, file in weight_map.items()}
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise error(f"model.safetensors (or {INDEX_NAME}) not found in {model_dir}")
    with safe_open(path, framework="pt", device="cpu") as weights:
        return dict.fromkeys(weights.keys(), path)
