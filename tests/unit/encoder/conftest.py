"""Shared fixtures: a tiny decoder checkpoint, written once per session."""

from pathlib import Path

import pytest

from services.decoder.models.default_model import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-model"))
