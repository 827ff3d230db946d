"""The decoder's fixture the cross-service tests share: the tiny random model loaded by the decoder.

Its own module, not the decoder's conftest.py, because tests/conftest.py imports it in .venv-xla
too, which has no transformers (the conftest builds transformers' checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_fp32(tiny_model_dir: Path) -> LoadedModel:
    # float32 so "the same tokens alone and batched" is not at the mercy of bf16 rounding ties.
    return load_model(tiny_model_dir, dtype="float32")
