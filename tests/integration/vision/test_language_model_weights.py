"""What the decoder's start-up check says of a vision-language checkpoint's weights: the tower, the
projector or connector are the encoder's and never named; a language model weight its text_config
turns off is refused as a causal LM's is (services/decoder/tests/models/test_checkpoint_shapes.py).
The LLaVA over a Qwen2 and the SmolVLM are checked where they are built (test_llava_qwen2.py,
test_smolvlm.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.decoder.models import loader
from tandem.decoder.models.loader import ModelLoadError


def assert_no_weight_named(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """check_checkpoint on `model_dir`, a whole vision-language checkpoint transformers saved, passes
    and warns of nothing: its tower's and projector's weights are not the decoder's to count as unread."""
    assert any("vision" in name for name in load_file(model_dir / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.check_checkpoint(model_dir, "float32")
    assert caplog.records == []


def test_a_llava_checkpoint_passes_with_no_weight_named(
    llava_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert_no_weight_named(llava_dir, caplog)


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
