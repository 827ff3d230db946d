"""Loading Hugging Face checkpoint directories, and the errors a broken one gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.weight_shapes import expected_weights
from tandem.decoder.models import loader
from tandem.decoder.models.checkpoint_shapes import text_model_shape
from tandem.decoder.models.loader import ModelLoadError, load_model

from ..conftest import Checkpoint
from .checkpoint_copies import copy_of, edit_json, edit_weights


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
    assert config.head_dim == 16 and config.qkv_bias and config.o_bias and config.mlp_bias


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


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(checkpoints: dict[str, Checkpoint], tmp_path: Path, name: str) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / name).unlink()
    with pytest.raises(ModelLoadError, match=name):
        load_model(model_dir)


def test_missing_weight_is_named(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_weights(model_dir, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir)


# variant, config.json changes, weight replaced (name, shape) or None, what the one line says after
# "<file>: weight ". Each was refused only by the load, after the server listened.
DISAGREEMENTS = {
    "num_attention_heads": (
        "qwen3",
        {"num_attention_heads": 2},
        None,
        "model.layers.0.self_attn.q_proj.weight has shape [128, 64] in the file, but config.json implies "
        "[64, 64] (num_attention_heads 2 x head_dim 32, hidden_size 64)",
    ),
    "num_key_value_heads": (
        "llama3",
        {"num_key_value_heads": 2},
        None,
        "model.layers.0.self_attn.k_proj.weight has shape [16, 64] in the file, but config.json implies "
        "[32, 64] (num_key_value_heads 2 x head_dim 16, hidden_size 64)",
    ),
    "head_dim": (
        "qwen3",
        {"head_dim": 16},
        None,
        "model.layers.0.self_attn.q_proj.weight has shape [128, 64] in the file, but config.json implies "
        "[64, 64] (num_attention_heads 4 x head_dim 16, hidden_size 64)",
    ),
    "vocab_size": (
        "qwen3",
        {"vocab_size": 2048},
        None,
        "model.embed_tokens.weight has shape [1024, 64] in the file, but config.json implies [2048, 64] "
        "(vocab_size 2048, hidden_size 64)",
    ),
    "intermediate_size": (
        "llama3",
        {"intermediate_size": 192},
        None,
        "model.layers.0.mlp.gate_proj.weight has shape [128, 64] in the file, but config.json implies "
        "[192, 64] (intermediate_size 192, hidden_size 64)",
    ),
    "hidden_size": (
        "llama3",
        {"hidden_size": 128, "head_dim": 16},
        None,
        "model.embed_tokens.weight has shape [1024, 64] in the file, but config.json implies [1024, 128] "
        "(vocab_size 1024, hidden_size 128)",
    ),
    "a projection": (
        "llama3",
        {},
        ("model.layers.1.self_attn.v_proj.weight", (8, 64)),
        "model.layers.1.self_attn.v_proj.weight has shape [8, 64] in the file, but config.json implies "
        "[16, 64] (num_key_value_heads 1 x head_dim 16, hidden_size 64)",
    ),
    "a norm": (
        "llama3",
        {},
        ("model.norm.weight", (32,)),
        "model.norm.weight has shape [32] in the file, but config.json implies [64] (hidden_size 64)",
    ),
    "qwen3's k_norm": (
        "qwen3",
        {},
        ("model.layers.0.self_attn.k_norm.weight", (16,)),
        "model.layers.0.self_attn.k_norm.weight has shape [16] in the file, but config.json implies [32] "
        "(head_dim 32)",
    ),
    "an attention bias": (
        "llama2-bias",
        {},
        ("model.layers.0.self_attn.o_proj.bias", (32,)),
        "model.layers.0.self_attn.o_proj.bias has shape [32] in the file, but config.json implies [64] "
        "(hidden_size 64)",
    ),
    "qwen2's k_proj bias": (
        "qwen2",
        {},
        ("model.layers.1.self_attn.k_proj.bias", (16,)),
        "model.layers.1.self_attn.k_proj.bias has shape [16] in the file, but config.json implies [32] "
        "(num_key_value_heads 2 x head_dim 16)",
    ),
    "mistral's key heads": (
        "mistral",
        {"num_key_value_heads": 4},
        None,
        "model.layers.0.self_attn.k_proj.weight has shape [32, 64] in the file, but config.json implies "
        "[64, 64] (num_key_value_heads 4 x head_dim 16, hidden_size 64)",
    ),
    "an untied head": (
        "llama3",
        {},
        ("lm_head.weight", (1000, 64)),
        "lm_head.weight has shape [1000, 64] in the file, but config.json implies [1024, 64] "
        "(vocab_size 1024, hidden_size 64)",
    ),
}


@pytest.mark.parametrize("kind", list(DISAGREEMENTS))
def test_a_config_that_disagrees_with_a_weight_shape_is_refused_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, kind: str
) -> None:
    """check_checkpoint (run before listening) compares every header shape with what config.json
    implies; no model is built and no tensor read."""
    variant, changes, replaced, said = DISAGREEMENTS[kind]
    model_dir = copy_of(checkpoints[variant], tmp_path)
    edit_json(model_dir / "config.json", **changes)
    if replaced is not None:
        edit_weights(model_dir, lambda w: w.update({replaced[0]: torch.zeros(replaced[1])}))
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir)
    assert str(raised.value) == f"{model_dir / 'model.safetensors'}: weight {said}"


@pytest.mark.parametrize(
    ("variant", "changes", "name"),
    [
        ("qwen3", {"tie_word_embeddings": False}, "lm_head.weight"),
        ("llama3", {"attention_bias": True}, "model.layers.0.self_attn.q_proj.bias"),
        ("llama3", {"mlp_bias": True}, "model.layers.0.mlp.gate_proj.bias"),
    ],
)
def test_a_weight_the_config_implies_and_the_file_lacks_is_refused_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, variant: str, changes: dict, name: str
) -> None:
    model_dir = copy_of(checkpoints[variant], tmp_path)
    edit_json(model_dir / "config.json", **changes)
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir)
    assert str(raised.value) == f"weight {name} not found in the checkpoint in {model_dir}"


def test_a_qwen2_without_its_q_proj_bias_is_refused_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """Qwen2's config.json says nothing of biases: its architecture has them on q/k/v_proj."""
    model_dir = copy_of(checkpoints["qwen2"], tmp_path)
    edit_weights(model_dir, lambda w: w.pop("model.layers.0.self_attn.q_proj.bias"))
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir)
    assert str(raised.value) == (
        f"weight model.layers.0.self_attn.q_proj.bias not found in the checkpoint in {model_dir}"
    )


def test_qwen2_and_mistral_files_hold_exactly_the_weights_their_configs_imply(
    checkpoints: dict[str, Checkpoint],
) -> None:
    """No o_proj bias is expected of a Qwen2 (Llama's attention_bias would ask for one), none at all of
    a Mistral: what transformers saved is what the check asks for, no weight left unread."""
    for variant in ("qwen2", "mistral"):
        path = checkpoints[variant].path
        config = loader.check_checkpoint(path)
        expected = expected_weights(text_model_shape(config))
        assert expected.keys() == load_file(path / "model.safetensors").keys()


def test_the_default_model_passes_the_check(smollm2_dir: Path) -> None:
    config = loader.check_checkpoint(smollm2_dir)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)


def test_unsupported_dtype_lists_the_supported_ones(checkpoints: dict[str, Checkpoint]) -> None:
    with pytest.raises(ModelLoadError, match="bfloat16, float16, float32"):
        load_model(checkpoints["qwen3"].path, dtype="int8")


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.float8_e4m3fn, torch.bool])
def test_a_weight_stored_as_quantized_or_integer_data_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, dtype: torch.dtype
) -> None:
    """A cast turned these into other numbers (an FP8 weight without its scale) and served them; the
    header says the type, so the check before listening refuses it (the load refused it, after)."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    edit_weights(model_dir, lambda w: w.update({name: w[name].to(dtype)}))
    with pytest.raises(ModelLoadError, match=rf"weight {name} is stored as \w+, not a type .* F32, F64\)"):
        loader.check_checkpoint(model_dir)
