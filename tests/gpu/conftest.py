"""Tests that need an NVIDIA GPU: marked `gpu`, skipped (reason printed by `-ra`) without one.

`scripts/device_check.sh` runs them on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.models.default_model import make_model

NO_GPU = "needs an NVIDIA GPU: torch.cuda.is_available() is False (CPU-only torch or no device)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny"), shape="tiny", seed=0)
