"""Copies of the PEFT adapter the adapter-reading tests start from (conftest.py: adapter_dir), with
settings changed."""

from __future__ import annotations

import json
from pathlib import Path


def copy_with(adapter_dir: Path, out: Path, **settings: object) -> Path:
    out.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text()) | settings
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    return out
