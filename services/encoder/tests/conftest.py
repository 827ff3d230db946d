"""Shared fixtures: a tiny decoder checkpoint, written once per session (common/tests/fixtures.py)."""

from pathlib import Path

import pytest

from common.tests.fixtures import environ, tiny_model_dir  # noqa: F401  (fixtures, found by name)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:  # noqa: F811  (the fixture imported above)
    return tiny_model_dir


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA checkpoint (CLIP tower, 36 px images): the encoder's image half, for real."""
    from services.encoder.tests.vision_checkpoints import make_llava

    return make_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")
