"""Shared fixtures: a tiny decoder checkpoint, written once per session."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir
