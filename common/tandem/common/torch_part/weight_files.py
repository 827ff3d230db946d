"""Which file of a Hugging Face checkpoint holds each weight: model.safetensors, or the shard that
model.safetensors.index.json names. Both services read single weights by name this way (the encoder a
vision tower's, either service a token-table sample) without opening the other shards."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from tandem.common.checkpoint import read_json

INDEX_NAME = "model.safetensors.index.json"


def weight_names(model_dir: Path, error: Callable[[str], Exception]) -> dict[str, Path]:
    """Every weight name in the checkpoint in `model_dir` -> the file that holds it. Raises `error`
    naming what is missing or malformed."""
    files = index_files(model_dir, error)
    if files is not None:
        return files
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise error(f"model.safetensors (or {INDEX_NAME}) not found in {model_dir}")
    with safe_open(path, framework="pt", device="cpu") as weights:
        return dict.fromkeys(weights.keys(), path)


def index_files(model_dir: Path, error: Callable[[str], Exception]) -> dict[str, Path] | None:
    """The shard index's weight name -> file, each file inside `model_dir`; None without an index.
    Raises `error` naming the index when its map is malformed or names a file outside."""
    index_path = model_dir / INDEX_NAME
    if not index_path.is_file():
        return None
    weight_map = read_json(index_path, error).get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise error(f"{index_path}: weight_map must map weight names to file names")
    return {name: shard_path(model_dir, file, error) for name, file in weight_map.items()}


def shard_path(model_dir: Path, name: str, error: Callable[[str], Exception]) -> Path:
    """A file the index names, which must lie inside the checkpoint directory: an index naming
    /etc/passwd or ../other/model.safetensors would have been opened as a weight file. The name is
    judged as written, not where symbolic links lead: a Hugging Face cache snapshot's files are
    links into its blobs directory, outside the snapshot, put there by whoever made the directory."""
    normal = os.path.normpath(name)
    if os.path.isabs(normal) or normal == ".." or normal.startswith(".." + os.sep):
        raise error(f"{INDEX_NAME} in {model_dir}: file {name!r} lies outside the checkpoint directory")
    return model_dir / name
