"""Checkpoints shared by the distributed tests: the embedded tiny model and a transformers-saved one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common.torch_part.random_model import train_tokenizer


@pytest.fixture(scope="session")
def hf_checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """transformers-saved variants (see services/decoder/tests/conftest.py): llama2-bias has biases
    on every projection and an untied head; llama3 has a single KV head; qwen2 has biases on q/k/v_proj
    (sharded with their rows) and none on o_proj."""
    # The unit tests' builder (the same checkpoints in both suites); imported here: it loads transformers.
    from services.decoder.tests.conftest import _build_checkpoint

    tokenizer_file = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer().save(str(tokenizer_file))
    return {
        name: _build_checkpoint(name, tmp_path_factory.mktemp(name), tokenizer_file).path
        for name in ("llama2-bias", "llama3", "qwen2")
    }
