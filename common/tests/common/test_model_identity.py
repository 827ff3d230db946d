"""A checkpoint's token-table sample and later weights' samples: the same model in any storage dtype
or shards, and never another model of the same shape, nor a tune that kept its base's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.common.torch_part.model_identity import (
    NUM_COLUMNS,
    NUM_ROWS,
    read_table_sample,
    read_weight_samples,
)
from tandem.common.torch_part.random_model import make_model
from tandem.common.vision_language import LAYOUTS, LLAVA, WeightLayout
from tandem.common.weight_sample import weights_agree


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny checkpoints of one shape (and one config and tokenizer), with different weights."""
    root = tmp_path_factory.mktemp("identity")
    return make_model(root / "a", seed=0), make_model(root / "b", seed=1)


def _table_checkpoint(out_dir: Path, table: torch.Tensor) -> Path:
    """A checkpoint of a token table alone (all the sample reads)."""
    out_dir.mkdir()
    (out_dir / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    save_file({"model.embed_tokens.weight": table}, out_dir / "model.safetensors")
    return out_dir


def test_two_checkpoints_of_one_shape_are_told_apart(two_models: tuple[Path, Path]) -> None:
    a, b = (read_table_sample(m, ValueError) for m in two_models)
    assert (a.vocab_size, a.hidden_size) == (b.vocab_size, b.hidden_size)
    assert len(a.values) == NUM_ROWS * NUM_COLUMNS
    assert not a.is_same_model(b) and not b.is_same_model(a)
    assert a.is_same_model(read_table_sample(two_models[0], ValueError))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_model_stored_in_another_dtype_is_the_same_model(tmp_path: Path, dtype: torch.dtype) -> None:
    # As a GGUF file imported in float32 for one service and in bfloat16 or float16 for the other.
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(1024, 64, generator=generator) * 0.02
    another = torch.randn(1024, 64, generator=generator) * 0.02
    original = read_table_sample(_table_checkpoint(tmp_path / "exact", exact), ValueError)
    rounded = read_table_sample(_table_checkpoint(tmp_path / "rounded", exact.to(dtype)), ValueError)
    assert all(a != b for a, b in zip(rounded.values, original.values, strict=True))  # all rounded
    assert rounded.is_same_model(original) and original.is_same_model(rounded)
    other = read_table_sample(_table_checkpoint(tmp_path / "other", another.to(dtype)), ValueError)
    assert not other.is_same_model(original)


def test_the_sample_is_read_from_the_shard_an_index_names(
    two_models: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "sharded"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model_dir / name).write_bytes((two_models[0] / name).read_bytes())
    weights = load_file(two_models[0] / "model.safetensors")
    table = {"model.embed_tokens.weight": weights.pop("model.embed_tokens.weight")}
    save_file(weights, model_dir / "model-00001-of-00002.safetensors")
    save_file(table, model_dir / "model-00002-of-00002.safetensors")
    weight_map = dict.fromkeys(weights, "model-00001-of-00002.safetensors")
    weight_map["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert read_table_sample(model_dir, ValueError) == read_table_sample(two_models[0], ValueError)


def test_a_checkpoint_without_a_token_table_is_an_error_naming_it(
    two_models: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "headless"
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes((two_models[0] / "config.json").read_bytes())
    save_file({"lm_head.weight": torch.zeros(2, 2)}, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight not found in .*headless"):
        read_table_sample(model_dir, ValueError)


def _variant(out_dir: Path, weights: dict[str, torch.Tensor], like: Path, shards: int = 1) -> Path:
    """`like`'s checkpoint (config, tokenizer) over `weights`, in `shards` files with an index."""
    out_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        if (like / name).exists():
            (out_dir / name).write_bytes((like / name).read_bytes())
    if shards == 1:
        save_file(weights, out_dir / "model.safetensors")
        return out_dir
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({name: weights[name] for name in part}, out_dir / file)
        weight_map.update(dict.fromkeys(part, file))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out_dir


def test_a_tune_that_kept_the_token_table_is_told_apart_by_its_later_weights(
    two_models: tuple[Path, Path], tmp_path: Path
) -> None:
    # A frozen-embedding fine-tune, or a merged LoRA: every layer moved, the table and norms kept.
    base = load_file(two_models[0] / "model.safetensors")
    noise = torch.Generator().manual_seed(7)
    tuned = {
        name: value
        if "embed_tokens" in name or "norm" in name
        else value + 0.05 * torch.randn(value.shape, generator=noise, dtype=value.dtype)
        for name, value in base.items()
    }
    tune = _variant(tmp_path / "tune", tuned, two_models[0])
    assert read_table_sample(tune, ValueError).is_same_model(read_table_sample(two_models[0], ValueError))
    ours, theirs = read_weight_samples(two_models[0], ValueError), read_weight_samples(tune, ValueError)
    assert [s.name for s in ours] == [s.name for s in theirs]
    assert any(s.name.endswith("mlp.down_proj.weight") for s in ours)
    assert any(s.name == "model.norm.weight" and (s.rows, len(s.values)) == (1, NUM_COLUMNS) for s in ours)
    assert not weights_agree(ours, theirs)


@pytest.mark.parametrize(("dtype", "shards"), [(torch.float32, 2), (torch.bfloat16, 1), (torch.float16, 2)])
def test_one_model_stored_in_any_dtype_or_shards_has_the_same_weight_samples(
    two_models: tuple[Path, Path], tmp_path: Path, dtype: torch.dtype, shards: int
) -> None:
    base = load_file(two_models[0] / "model.safetensors")
    stored = _variant(tmp_path / "v", {n: v.to(dtype) for n, v in base.items()}, two_models[0], shards)
    ours = read_weight_samples(two_models[0], ValueError)
    assert weights_agree(ours, read_weight_samples(stored, ValueError))
    assert not weights_agree(ours, read_weight_samples(two_models[1], ValueError))


def test_a_checkpoint_with_none_of_the_sampled_weights_has_no_weight_samples(tmp_path: Path) -> None:
    assert read_weight_samples(_table_checkpoint(tmp_path / "t", torch.ones(4, 4)), ValueError) == ()


def _llava(out_dir: Path, weights: dict[str, torch.Tensor], layout: WeightLayout) -> Path:
    """A LLaVA checkpoint whose language model is `weights` (a causal LM's names), stored in `layout`."""
    out_dir.mkdir()
    (out_dir / "config.json").write_text(json.dumps({"architectures": [LLAVA]}))
    save_file({layout.checkpoint_name(n): v for n, v in weights.items()}, out_dir / "model.safetensors")
    return out_dir


def test_one_llava_model_has_the_same_weight_samples_in_either_layout_and_a_tune_in_the_other_differs(
    two_models: tuple[Path, Path], tmp_path: Path
) -> None:
    # transformers >= 4.52 and the Hub's llava-hf name every tensor apart: the samples are named as a
    # causal LM's, or no name is shared and nothing is compared.
    base = load_file(two_models[0] / "model.safetensors")
    tuned = {n: v if "embed_tokens" in n else v * 2 for n, v in base.items()}
    new, hub = LAYOUTS[LLAVA]
    ours = read_weight_samples(_llava(tmp_path / "new", base, new), ValueError)
    assert [s.name for s in ours] == [s.name for s in read_weight_samples(two_models[0], ValueError)]
    assert weights_agree(ours, read_weight_samples(_llava(tmp_path / "hub", base, hub), ValueError))
    assert not weights_agree(ours, read_weight_samples(_llava(tmp_path / "tune", tuned, hub), ValueError))
