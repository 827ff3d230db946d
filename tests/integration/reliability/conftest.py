"""Live decoder + encoder shared by the reliability tests of one module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.models.loader import LoadedModel

from .harness import Services


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, tiny_fp32: LoadedModel):
    running = Services(tiny_model_dir, tiny_fp32)
    yield running
    running.close()
