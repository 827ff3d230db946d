"""The soft-prompt embedder prepends a PEFT prompt-tuning adapter's rows to the looked-up text."""

import json
from pathlib import Path

import pytest
import torch

from services.encoder.tests.helpers import write_prompt_adapter
from tandem.encoder.embedder import EmbedderLoadError, Pooling
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.soft_prompt import SoftPromptEmbedder

HIDDEN_SIZE = 64  # the tiny checkpoint's


def test_virtual_rows_come_first_then_the_text_rows(tiny_model: Path, tmp_path: Path) -> None:
    prompt = write_prompt_adapter(tmp_path / "adapter", num_virtual_tokens=3, token_dim=HIDDEN_SIZE)
    embedder = SoftPromptEmbedder.load(tiny_model, tmp_path / "adapter", torch.float32)
    lookup = LookupEmbedder.load(tiny_model, torch.float32)
    ids = embedder.tokenize("hello world", add_special_tokens=False)
    rows = embedder.embed(ids, Pooling.NONE)  # [3 + num_tokens, hidden_size]
    assert rows.shape == (3 + len(ids), HIDDEN_SIZE)
    assert torch.equal(rows[:3], prompt)
    assert torch.equal(rows[3:], lookup.embed(ids, Pooling.NONE))
    assert embedder.info.kind == "soft-prompt" and embedder.info.num_virtual_tokens == 3


def test_mean_pooling_averages_virtual_and_text_rows(tiny_model: Path, tmp_path: Path) -> None:
    write_prompt_adapter(tmp_path / "adapter", num_virtual_tokens=2, token_dim=HIDDEN_SIZE)
    embedder = SoftPromptEmbedder.load(tiny_model, tmp_path / "adapter", torch.float32)
    pooled = embedder.embed([1, 2], Pooling.MEAN)
    torch.testing.assert_close(pooled, embedder.embed([1, 2], Pooling.NONE).mean(dim=0, keepdim=True))


def test_token_dim_must_match_the_models_hidden_size(tiny_model: Path, tmp_path: Path) -> None:
    write_prompt_adapter(tmp_path / "adapter", num_virtual_tokens=3, token_dim=32)
    with pytest.raises(EmbedderLoadError, match="token_dim 32 does not match the model's hidden_size 64"):
        SoftPromptEmbedder.load(tiny_model, tmp_path / "adapter", torch.float32)


def test_only_prompt_tuning_adapters_are_accepted(tiny_model: Path, tmp_path: Path) -> None:
    write_prompt_adapter(tmp_path / "adapter", num_virtual_tokens=3, token_dim=HIDDEN_SIZE, peft_type="LORA")
    with pytest.raises(EmbedderLoadError, match="only 'PROMPT_TUNING'"):
        SoftPromptEmbedder.load(tiny_model, tmp_path / "adapter", torch.float32)


def test_prompt_shape_must_match_the_adapter_config(tiny_model: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    write_prompt_adapter(adapter, num_virtual_tokens=3, token_dim=HIDDEN_SIZE)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"num_virtual_tokens": 5}))
    with pytest.raises(EmbedderLoadError, match=r"prompt_embeddings has shape \[3, 64\], expected"):
        SoftPromptEmbedder.load(tiny_model, adapter, torch.float32)


def test_missing_adapter_files_are_named(tiny_model: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with pytest.raises(EmbedderLoadError, match="adapter_config.json not found"):
        SoftPromptEmbedder.load(tiny_model, adapter, torch.float32)
    write_prompt_adapter(adapter, num_virtual_tokens=3, token_dim=HIDDEN_SIZE)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(
        EmbedderLoadError, match=r"adapter_model.safetensors \(holding prompt_embeddings\) not found in "
    ):
        SoftPromptEmbedder.load(tiny_model, adapter, torch.float32)
