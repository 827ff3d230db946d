"""Both pyproject.toml files apply cleanly with setuptools: no deprecation warning on every install."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("project", [".", "clients/python"])
def test_pyproject_applies_without_warnings_and_declares_an_spdx_license(
    project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = REPO_ROOT / project
    monkeypatch.chdir(directory)  # setuptools resolves the project's paths from the working directory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), directory / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert distribution.metadata.license_expression == "Apache-2.0"
