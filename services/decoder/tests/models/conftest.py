"""Fixtures the tests of models/ share: the PEFT adapter that test_peft_adapter.py, test_peft_weights.py
and test_adapter_files.py read and copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.decoder.tests.lora_adapters import SPECS, make_adapter


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("mlp8"), SPECS["mlp8"], seed=1)
