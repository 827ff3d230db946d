"""Shared fixtures: a tiny decoder checkpoint, written once per session (common/tests/fixtures.py)."""

from pathlib import Path

import pytest

from common.tests.fixtures import environ, tiny_model_dir  # noqa: F401  (fixtures, found by name)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:  # noqa: F811  (the fixture imported above)
    return tiny_model_dir
