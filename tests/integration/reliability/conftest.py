"""Live decoder + encoder shared by the reliability tests of one module."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.decoder.models.default_model import make_model
from services.decoder.models.loader import LoadedModel, load_model

from .harness import Services


@pytest.fixture(scope="session")
def reliability_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("reliability-tiny"))


@pytest.fixture(scope="session")
def reliability_loaded(reliability_model_dir: Path) -> LoadedModel:
    return load_model(reliability_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def services(reliability_model_dir: Path, reliability_loaded: LoadedModel):
    running = Services(reliability_model_dir, reliability_loaded)
    yield running
    running.close()
