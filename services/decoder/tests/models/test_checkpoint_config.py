"""config.json (and generation_config.json) read into a ModelConfig, and the refusals of one the decoder
cannot serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.decoder.models import loader
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.registry import MODEL_CLASSES

from ..conftest import Checkpoint
from .checkpoint_copies import copy_of, edit_json


def test_eos_ids_come_from_generation_config_then_config(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    edit_json(model_dir / "config.json", eos_token_id=5)
    edit_json(model_dir / "generation_config.json", eos_token_id=[7, 8])
    assert load_model(model_dir).config.eos_token_ids == (7, 8)
    (model_dir / "generation_config.json").unlink()
    assert load_model(model_dir).config.eos_token_ids == (5,)


def test_unsupported_architecture_is_named_with_the_supported_ones(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_json(model_dir / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as error:
        load_model(model_dir)
    assert all(name in str(error.value) for name in MODEL_CLASSES)


def test_unsupported_rope_type_is_named(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_json(
        model_dir / "config.json", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    )
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("architectures", "message"),
    [
        ("LlamaForCausalLM", "architectures must be a list of class names"),
        ([{}], "architectures must be"),
        # These raised in the vision-language test first (TypeError, KeyError): a traceback at start
        (5, "architectures must be a list of class names"),
        ({"a": 1}, "architectures must be a list of class names"),
        ([["LlamaForCausalLM"]], "architectures must be a list of class names"),
    ],
)
def test_architectures_that_are_not_a_list_of_names_are_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, architectures: Any, message: str
) -> None:
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_json(model_dir / "config.json", architectures=architectures)
    with pytest.raises(ModelLoadError, match=message):
        loader.check_checkpoint(model_dir)
