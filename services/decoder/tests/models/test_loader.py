"""Loading Hugging Face checkpoint directories, and the errors a broken one gives."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.decoder.models import loader
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.registry import MODEL_CLASSES

from ..conftest import Checkpoint
from .helpers import PagedRun


def copy_of(checkpoint: Checkpoint, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint.path, tmp_path / "model"))


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def edit_weights(model_dir: Path, edit: Any) -> None:
    weights = load_file(model_dir / "model.safetensors")
    edit(weights)
    save_file(weights, model_dir / "model.safetensors")


def test_weights_are_loaded_in_the_requested_dtype_with_nothing_left_on_meta(
    checkpoints: dict[str, Checkpoint],
) -> None:
    for dtype, torch_dtype in [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
    ]:
        loaded = load_model(checkpoints["llama3"].path, dtype=dtype)
        tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
        assert all(t.device.type == "cpu" for t in tensors)
        assert {p.dtype for p in loaded.model.parameters()} == {torch_dtype}
        assert loaded.model.rotary.inv_freq.dtype == torch.float32  # RoPE angles stay fp32
        assert not any(p.requires_grad for p in loaded.model.parameters())
        assert loaded.config.dtype == torch_dtype and loaded.config.architecture == "LlamaForCausalLM"


def test_tied_checkpoint_has_no_lm_head_and_reads_the_embedding(checkpoints: dict[str, Checkpoint]) -> None:
    qwen3 = checkpoints["qwen3"]
    assert "lm_head.weight" not in load_file(qwen3.path / "model.safetensors")
    loaded = load_model(qwen3.path, dtype="float32")
    assert loaded.config.tie_word_embeddings and loaded.model.lm_head is None


def test_head_dim_absent_from_config_defaults_to_hidden_over_heads(
    checkpoints: dict[str, Checkpoint],
) -> None:
    config = load_model(checkpoints["llama2-bias"].path, dtype="float32").config
    assert config.head_dim == 16 and config.attention_bias and config.mlp_bias


def test_kv_cache_is_allocated_per_layer_in_the_model_dtype(checkpoints: dict[str, Checkpoint]) -> None:
    loaded = load_model(checkpoints["qwen3"].path, dtype="bfloat16")
    caches = loaded.model.allocate_kv_cache(num_blocks=10, block_size=16)
    c = loaded.config
    assert len(caches) == c.num_layers
    assert all(
        t.shape == (2, 10, 16, c.num_kv_heads, c.head_dim) and t.dtype == torch.bfloat16 for t in caches
    )
    # On the CPU the layers are contiguous views of one zeroed pool (common/torch_part/huge_pages.py): a write
    # to one layer's cache is not seen by another's.
    assert all(t.is_contiguous() and t.count_nonzero() == 0 for t in caches)
    caches[0].fill_(1.0)
    assert all(t.count_nonzero() == 0 for t in caches[1:])


def test_eos_ids_come_from_generation_config_then_config(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    edit_json(model_dir / "config.json", eos_token_id=5)
    edit_json(model_dir / "generation_config.json", eos_token_id=[7, 8])
    assert load_model(model_dir).config.eos_token_ids == (7, 8)
    (model_dir / "generation_config.json").unlink()
    assert load_model(model_dir).config.eos_token_ids == (5,)


def test_sharded_checkpoint_loads_the_same_model(
    checkpoints: dict[str, Checkpoint], hf_checkpoint_factory: Any
) -> None:
    sharded = hf_checkpoint_factory("llama3", max_shard_size="100KB")
    assert len(json.loads((sharded.path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(sharded.path.glob("model-*.safetensors"))) > 2
    single = load_model(checkpoints["llama3"].path, dtype="float32").model
    model = load_model(sharded.path, dtype="float32").model
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), single.state_dict().values(), strict=True)
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(PagedRun(model).step([(0, prompt)]), PagedRun(single).step([(0, prompt)]))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(checkpoints: dict[str, Checkpoint], tmp_path: Path, name: str) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / name).unlink()
    with pytest.raises(ModelLoadError, match=name):
        load_model(model_dir)


def test_missing_shard_is_named(hf_checkpoint_factory: Any) -> None:
    sharded = hf_checkpoint_factory("qwen3", max_shard_size="100KB")
    shard = sorted(sharded.path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(sharded.path)


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


def test_missing_weight_is_named(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_weights(model_dir, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir)


def test_misshaped_weight_is_named_with_expected_and_actual_shapes(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    edit_weights(model_dir, lambda w: w.update({name: torch.zeros(8, 64)}))
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \[8, 64\], expected \[16, 64\]"):
        load_model(model_dir)


def test_unsupported_dtype_lists_the_supported_ones(checkpoints: dict[str, Checkpoint]) -> None:
    with pytest.raises(ModelLoadError, match="bfloat16, float16, float32"):
        load_model(checkpoints["qwen3"].path, dtype="int8")


def test_tokenizer_larger_than_the_vocabulary_is_rejected(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    edit_json(model_dir / "config.json", vocab_size=512)
    edit_weights(
        model_dir, lambda w: w.update({"model.embed_tokens.weight": w["model.embed_tokens.weight"][:512]})
    )
    with pytest.raises(ModelLoadError, match="tokenizer.json has 1024 tokens"):
        load_model(model_dir)


def test_loading_logs_its_progress_and_a_summary(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A large checkpoint says how far it got every PROGRESS_INTERVAL_S; here every weight does."""
    monkeypatch.setattr(loader, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        model = load_model(checkpoint.path, dtype="float32").model
    lines = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    num_weights = len(list(model.parameters()))
    progress = [re.match(r"loading weights: (\d+)/(\d+) \((\d+)%", line) for line in lines[:-1]]
    assert all(progress) and [int(m.group(1)) for m in progress] == list(range(1, num_weights))
    assert {int(m.group(2)) for m in progress} == {num_weights}
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert re.fullmatch(rf"loaded {num_weights} weights \({num_bytes / 1e9:.2f} GB\) in \d+\.\d s", lines[-1])
