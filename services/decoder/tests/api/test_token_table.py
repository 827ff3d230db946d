"""The samples GetModelInfo reports: the checkpoint's own token table's and later weights', which a
gateway compares across its replicas; unset, with a warning, for a checkpoint it cannot read them from."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from common.tests.common.gguf_files import Q, small_model, write_gguf
from tandem.common.token_table_sample import TableSample, sample_from_pb
from tandem.common.torch_part.gguf_import import import_gguf
from tandem.common.torch_part.random_model import make_model
from tandem.common.weight_sample import WeightSample, weight_sample_from_pb, weights_agree
from tandem.decoder.api.token_table import checkpoint_sample, checkpoint_weight_samples


def test_a_checkpoint_of_the_same_shape_with_other_weights_reports_another_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    ours = checkpoint_sample(tiny_model_dir)
    theirs = checkpoint_sample(make_model(tmp_path / "other", shape="tiny-random", seed=1))
    assert ours is not None and theirs is not None
    assert (ours.vocab_size, ours.hidden_size) == (theirs.vocab_size, theirs.hidden_size)
    assert not sample_from_pb(ours).is_same_model(sample_from_pb(theirs))
    again = checkpoint_sample(tiny_model_dir)
    assert again is not None and sample_from_pb(again).is_same_model(sample_from_pb(ours))


def _sample(model_dir: Path) -> TableSample:
    sample = checkpoint_sample(model_dir)
    assert sample is not None
    return sample_from_pb(sample)


def _weights(model_dir: Path) -> list[WeightSample]:
    return [weight_sample_from_pb(sample) for sample in checkpoint_weight_samples(model_dir)]


def test_a_checkpoint_reports_its_last_layers_down_proj_and_final_norm(tiny_model_dir: Path) -> None:
    names = [sample.name for sample in _weights(tiny_model_dir)]
    assert names[0].endswith(".mlp.down_proj.weight") and "model.norm.weight" in names


def test_a_gguf_files_sample_is_its_dequantized_table_whatever_dtype_it_was_imported_in(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    model = small_model("qwen3", tokenizer.get_vocab_size())
    quantized = write_gguf(tmp_path / "q4.gguf", model, tokenizer, Q.Q4_0)
    f32_dir = import_gguf(quantized, tmp_path / "f32", dtype="float32")
    bf16_dir = import_gguf(quantized, tmp_path / "bf16", dtype="bfloat16")
    in_float32 = _sample(f32_dir)
    assert in_float32.is_same_model(_sample(bf16_dir))
    # Its later weights too, from the imported (dequantized) tensors.
    assert _weights(f32_dir) and weights_agree(_weights(f32_dir), _weights(bf16_dir))
    # The file quantized from a model is not that model: its rows are off by the quantization's error.
    unquantized = write_gguf(tmp_path / "f32.gguf", model, tokenizer)
    assert not in_float32.is_same_model(_sample(import_gguf(unquantized, tmp_path / "o", dtype="float32")))


def test_a_checkpoint_without_a_token_table_reports_none_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="tandem.decoder"):
        assert checkpoint_sample(tmp_path) is None
    assert "model.embed_tokens.weight not found" in caplog.text


def test_a_checkpoint_whose_weights_cannot_be_read_reports_no_weight_samples_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with caplog.at_level(logging.WARNING, logger="tandem.decoder"):
        assert checkpoint_weight_samples(tmp_path) == []
    assert "no weight samples" in caplog.text and "model.safetensors" in caplog.text
