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

from tandem.common.weight_shapes import expected_weights
from tandem.decoder.models import loader
from tandem.decoder.models.checkpoint_shapes import text_model_shape
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


def split_safetensors(path: Path) -> tuple[bytes, bytes]:
    """(header JSON, tensor bytes) of a safetensors file: its first 8 bytes give the header's length."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return data[8 : 8 + length], data[8 + length :]


def with_header(header: bytes, body: bytes, length: int | None = None) -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + body


def overlapping_offsets(header: bytes, body: bytes) -> bytes:
    meta = json.loads(header)
    meta["model.norm.weight"]["data_offsets"] = meta["model.embed_tokens.weight"]["data_offsets"]
    return with_header(json.dumps(meta).encode(), body)


MALFORMED_FILES = {
    "header length past the end": lambda h, b: with_header(h, b, length=1 << 40),
    "header length 2^63": lambda h, b: with_header(h, b, length=1 << 63),
    "header that is no JSON": lambda h, b: with_header(b"not json" + b" " * (len(h) - 8), b),
    "header nested 100,000 deep": lambda h, b: with_header(b"[" * 100_000 + b"]" * 100_000, b),
    "tensor bytes cut short": lambda h, b: with_header(h, b[:-1000]),
    "overlapping offsets": overlapping_offsets,
    "empty file": lambda h, b: b"",
}


@pytest.mark.parametrize("case", list(MALFORMED_FILES))
def test_a_malformed_safetensors_file_is_named_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, case: str
) -> None:
    """check_checkpoint (run before listening) parses every header; safetensors' own error, a bare
    Exception, escaped the decoder's start-up as a traceback."""
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    path = model_dir / "model.safetensors"
    path.write_bytes(MALFORMED_FILES[case](*split_safetensors(path)))
    with pytest.raises(ModelLoadError, match=rf"{re.escape(str(path))} is not a readable safetensors file"):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize("name", ["/etc/passwd", "../elsewhere/model.safetensors", "sub/../../x.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, name: str
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ModelLoadError, match=rf"file {re.escape(repr(name))} lies outside the checkpoint"):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"w": 5}, "model.safetensors"])
def test_an_index_whose_weight_map_is_not_names_to_files_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, weight_map: Any
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="weight_map must map weight names to file names"):
        loader.check_checkpoint(model_dir)


def test_a_weight_in_two_shards_is_named_with_both(hf_checkpoint_factory: Any) -> None:
    sharded = hf_checkpoint_factory("qwen3", max_shard_size="100KB")
    first, second = sorted(sharded.path.glob("model-*.safetensors"))[:2]
    name = "model.norm.weight"
    for shard in (first, second):  # wherever the norm was, the first two shards now both hold it
        save_file(load_file(shard) | {name: torch.ones(64)}, shard)
    with pytest.raises(ModelLoadError, match=rf"weight {name} is in both {first.name} and {second.name}"):
        loader.check_checkpoint(sharded.path)


def test_weights_of_layers_past_num_hidden_layers_are_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """A config that says fewer layers than the file holds served the first layers alone: noise."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_json(model_dir / "config.json", num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.\S+ is of layer 1, but config\.json's "):
        loader.check_checkpoint(model_dir)


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


@pytest.mark.parametrize(
    ("name", "index", "value", "dtype", "message"),
    [
        (
            "model.embed_tokens.weight",
            (5, 3),
            float("nan"),
            "float32",
            r"holds nan at \[5, 3\] in torch.float32$",
        ),
        # k_proj is fused after q_proj's 64 rows: the error names the checkpoint's tensor and row.
        (
            "model.layers.1.self_attn.k_proj.weight",
            (3, 7),
            float("-inf"),
            "bfloat16",
            r"holds -inf at \[3, 7\] in torch.bfloat16$",
        ),
        (
            "model.norm.weight",
            (2,),
            3e38,
            "float16",
            r"holds inf at \[2\] in torch.float16 \(3e\+38 in the file\)",
        ),
    ],
)
def test_a_weight_that_is_not_finite_in_the_model_dtype_is_named(
    checkpoints: dict[str, Checkpoint],
    tmp_path: Path,
    name: str,
    index: tuple[int, ...],
    value: float,
    dtype: str,
    message: str,
) -> None:
    """One NaN or Inf weight can make every logit NaN (each request then ends INTERNAL from a server
    that said it was ready); a finite float32 value past float16's range is Inf once cast."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)

    def poison(weights: dict[str, torch.Tensor]) -> None:
        weights[name][index] = value

    edit_weights(model_dir, poison)
    with pytest.raises(ModelLoadError, match=rf"weight {re.escape(name)} {message}"):
        load_model(model_dir, dtype=dtype)


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


def test_a_tokenizer_file_larger_than_the_limit_is_refused_from_its_size(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 GB tokenizer.json took 1.25 GB to parse before it was found wanting."""
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    size = (model_dir / "tokenizer.json").stat().st_size
    monkeypatch.setattr(loader, "MAX_TOKENIZER_BYTES", size - 1)
    with pytest.raises(ModelLoadError, match=rf"tokenizer.json has {size:,} bytes, more than the limit of"):
        loader.check_checkpoint(model_dir)


def test_a_tokenizer_id_past_the_vocabulary_is_refused_though_the_count_fits(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """1,024 entries, one of them id 5000: a text holding it indexed the embedding table past its end."""
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 300)
    vocab[token] = 5000
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    said = f"{model_dir / 'tokenizer.json'} maps {token!r} to id 5000, past vocab_size 1024 in "
    with pytest.raises(ModelLoadError, match=re.escape(f"{said}{model_dir / 'config.json'}")):
        loader.check_checkpoint(model_dir)


def test_a_vision_checkpoint_s_tokenizer_is_held_to_text_config_s_vocab_size_naming_both_files(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """The language model's table has text_config's rows; an outer vocab_size (older LLaVA configs carry
    one) sizes nothing. The refusal said 'the model's vocab_size', naming neither file nor text_config."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    text = json.loads((model_dir / "config.json").read_text())  # its tokenizer.json has 1,024 tokens
    llava = {"architectures": ["LlavaForConditionalGeneration"], "vocab_size": 1024}
    text_config = {**text, "model_type": "llama", "vocab_size": 512}
    (model_dir / "config.json").write_text(json.dumps({**llava, "text_config": text_config}))
    said = (
        f"{model_dir / 'tokenizer.json'} has 1024 tokens, more than text_config's vocab_size 512 in "
        f"{model_dir / 'config.json'}"
    )
    with pytest.raises(ModelLoadError, match=re.escape(said)):
        loader.check_checkpoint(model_dir)


def test_shards_that_are_links_out_of_the_directory_load_as_in_a_hugging_face_cache(
    hf_checkpoint_factory: Any, tmp_path: Path
) -> None:
    """A hub snapshot's files are symbolic links into ../../blobs: the index's names are judged as
    written, so the files they lead to load."""
    sharded = hf_checkpoint_factory("qwen3", max_shard_size="100KB")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sharded.path.glob("model-*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    assert load_model(sharded.path, dtype="float32").config.num_layers == 2


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        # json's message named no file; the start-up then ended after the server had listened.
        ("tokenizer_config.json", b"{", r"tokenizer_config\.json is not valid JSON"),
        # An AttributeError traceback from the chat template's loader.
        (
            "tokenizer_config.json",
            b'{"chat_template": [1, 2]}',
            r"chat_template must be a string or a list of",
        ),
        ("chat_template.json", b"[]", r"chat_template\.json must hold a JSON object"),
        ("chat_template.jinja", b"\xff\xfe{{ x }}", r"chat_template\.jinja is not UTF-8 text"),
        (
            "chat_template.jinja",
            b"x" * (64 * 1024 + 1),
            r"chat_template\.jinja has 65,537 characters, more than 65,536",
        ),
    ],
)
def test_a_broken_chat_template_file_is_named_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / name).write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"{bos_token: <s>}", r"is not valid JSON"), (b'{"bos_token": "\xff"}', r"is not UTF-8 text")],
)
def test_a_broken_special_tokens_map_is_named_before_the_server_listens_when_it_is_read(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, content: bytes, message: str
) -> None:
    # The template's special-token names come from it when tokenizer_config.json has no
    # added_tokens_decoder (template_source.read_special_tokens); json's message named no file.
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (model_dir / "special_tokens_map.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"special_tokens_map\.json " + message):
        loader.check_checkpoint(model_dir)
    # One with added_tokens_decoder does not read the file, as transformers does not.
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    loader.check_checkpoint(model_dir)


def test_a_named_chat_template_list_is_accepted(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    templates = [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "x"}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    loader.check_checkpoint(model_dir)
