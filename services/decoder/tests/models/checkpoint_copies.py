"""Copies of a test checkpoint directory, with config.json or the weights edited."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from ..conftest import Checkpoint


def copy_of(checkpoint: Checkpoint, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint.path, tmp_path / "model"))


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def edit_weights(model_dir: Path, edit: Any) -> None:
    weights = load_file(model_dir / "model.safetensors")
    edit(weights)
    save_file(weights, model_dir / "model.safetensors")
