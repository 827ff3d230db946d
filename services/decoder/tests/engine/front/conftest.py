"""LoRA adapters of the tiny model, made once a module, for the engine's LoRA and adapter-loading tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.decoder.tests.lora_adapters import SPECS, make_adapter


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, Path], ...]:
    out = tmp_path_factory.mktemp("adapters")
    return tuple(
        (name, make_adapter(tiny_model_dir, out / name, SPECS[name], seed=i))
        for i, name in enumerate(("qv4", "mlp8"))
    )
