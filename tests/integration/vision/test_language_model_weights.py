"""What the decoder's start-up check says of a vision-language checkpoint's weights: the tower, the
projector or connector are the encoder's and never named; a language model weight its text_config
turns off is refused as a causal LM's is (services/decoder/tests/models/test_checkpoint_shapes.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.encoder.tests.smolvlm_checkpoint import make_smolvlm
from services.encoder.tests.vision_checkpoints import make_llava
from tandem.decoder.models import loader
from tandem.decoder.models.loader import ModelLoadError


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_smolvlm(tmp_path_factory.mktemp("smolvlm") / "tiny-smolvlm")


@pytest.fixture(scope="module")
def llava_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava-qwen2") / "tiny-llava-qwen2", text_model="qwen2")


def test_llava_and_smolvlm_checkpoints_pass_with_no_weight_named(
    llava_dir: Path, llava_qwen2_dir: Path, smolvlm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers saved each whole: its vision weights are not the decoder's to count as unread, and
    a Qwen2 language model's q/k/v biases are its architecture's."""
    for model_dir in (llava_dir, llava_qwen2_dir, smolvlm_dir):
        names = load_file(model_dir / "model.safetensors").keys()
        assert any("vision" in name for name in names)
        with caplog.at_level(logging.WARNING, logger=loader.__name__):
            loader.check_checkpoint(model_dir, "float32")
    assert caplog.records == []


def test_a_bias_the_text_config_turns_off_is_refused_naming_the_text_config(
    llava_dir: Path, tmp_path: Path
) -> None:
    model_dir = Path(shutil.copytree(llava_dir, tmp_path / "llava"))
    weights = load_file(model_dir / "model.safetensors")
    (key,) = [name for name in weights if name.endswith("model.layers.0.self_attn.v_proj.weight")]
    bias = key.removesuffix("weight") + "bias"
    save_file(weights | {bias: torch.ones(len(weights[key]))}, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir, "float32")
    assert str(raised.value) == (
        f"{model_dir / 'model.safetensors'}: weight {bias} is in the file, but config.json's text_config "
        "says attention_bias false: the model would serve without it"
    )
