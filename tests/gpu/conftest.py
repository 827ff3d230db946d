"""Tests that need an NVIDIA GPU: marked `gpu`, skipped (reason printed by `-ra`) without one.

`scripts/device_check.sh` runs them on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

NO_GPU = "needs an NVIDIA GPU: torch.cuda.is_available() is False (CPU-only torch or no device)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
