"""`python -m tandem.decoder` on a checkpoint the start-up check refuses: one line and exit 2, and no
port bound. A weight its config turns off (models/checkpoint_shapes.py) and a GGUF tensor of a type
the gguf package cannot read (common/torch_part/gguf_import.py) were served or refused later: the
one dropped in silence, the other refused once every tensor before it was dequantized."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from common.tests.common.gguf_files import small_model, write_gguf
from tandem.common.torch_part.gguf_import import readable_types
from tandem.decoder.api import serving as decoder_serving
from tandem.decoder.api.main import main

PREFIX = "tandem serve decoder: --model (TANDEM_MODEL): "


def _refusal(err: str) -> str:
    """The one line the refusal printed (an import's progress, logged, may stand before it)."""
    lines = [line for line in err.splitlines() if line.startswith("tandem serve decoder:")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    return lines[0].removeprefix(PREFIX)


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every server the decoder would start: none, for a refused start-up."""
    started: list[object] = []
    monkeypatch.setattr(decoder_serving, "start_server", lambda *args: started.append(args))
    return started


def test_a_bias_the_config_turns_off_is_one_line_and_exit_2_before_anything_listens(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], servers: list[object], environ
) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    weights = load_file(model_dir / "model.safetensors")
    bias = {
        "model.layers.0.self_attn.k_proj.bias": torch.ones(
            len(weights["model.layers.0.self_attn.k_proj.weight"])
        )
    }
    save_file(weights | bias, model_dir / "model.safetensors")
    assert main(["--model", str(model_dir), "--port", "0", "--dtype", "float32"]) == 2
    assert _refusal(capsys.readouterr().err) == (
        f"{model_dir / 'model.safetensors'}: weight model.layers.0.self_attn.k_proj.bias is in the file, but "
        "config.json says attention_bias false: the model would serve without it"
    )
    assert servers == []


def test_a_gguf_tensor_of_a_type_gguf_cannot_read_is_one_line_and_exit_2_before_anything_listens(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    servers: list[object],
    environ,
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the import's model cache
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    model = small_model("llama", tokenizer.get_vocab_size())
    q8_1 = np.zeros((128, 2 * 40), dtype=np.uint8)  # up_proj's 128 rows of two Q8_1 blocks of 32 values
    Q = gguf.GGMLQuantizationType
    path = write_gguf(
        tmp_path / "m.gguf", model, tokenizer, Q.Q4_0, raw_tensors={"blk.1.ffn_up.weight": (q8_1, Q.Q8_1)}
    )
    assert main(["--model", str(path), "--quantization", "gguf", "--port", "0", "--dtype", "float32"]) == 2
    assert _refusal(capsys.readouterr().err) == (
        f"{path}: tensor blk.1.ffn_up.weight is of GGML type Q8_1, which the gguf package cannot dequantize "
        f"(readable: {', '.join(readable_types())})"
    )
    assert servers == []
