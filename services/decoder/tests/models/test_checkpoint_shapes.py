"""The shapes a config implies are the ones the built model reads. What a checkpoint whose shapes
disagree gets is test_loader.py's (check_checkpoint, before the server listens); what one holding
weights the model does not read gets is here."""

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
from transformers import AutoModelForCausalLM

from tandem.common.weight_shapes import expected_weights
from tandem.decoder.models import checkpoint_shapes, loader, safetensors_weights
from tandem.decoder.models.checkpoint_shapes import MAX_NAMED_UNREAD, text_model_shape
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.registry import MODEL_CLASSES

from ..conftest import Checkpoint


def test_the_shapes_checked_are_those_the_built_model_reads(checkpoint: Checkpoint) -> None:
    """The check's shapes come from the config alone; the loader's from the built model's parameters
    (checkpoint_parts). They must agree for every family variant, or one would refuse what the other
    loads."""
    config = loader.check_checkpoint(checkpoint.path)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    read = {
        part.name: part.shape for name, _ in model.named_parameters() for part in model.checkpoint_parts(name)
    }
    assert {name: w.shape for name, w in expected_weights(text_model_shape(config)).items()} == read


def copy_with(checkpoint: Checkpoint, tmp_path: Path, added: dict[str, torch.Tensor], **config: Any) -> Path:
    """A copy of `checkpoint` whose file also holds `added` and whose config.json has `config` changed."""
    model_dir = Path(shutil.copytree(checkpoint.path, tmp_path / "model"))
    path = model_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    weights = load_file(model_dir / "model.safetensors")
    save_file(weights | added, model_dir / "model.safetensors")
    return model_dir


# A tensor the architecture would read were a config.json setting the other way -> (variant, what is
# added, config.json changes, what the refusal says after "weight <name> is in the file, but ").
FLAGGED = {
    "a q_proj bias beside attention_bias false": (
        "llama3",
        {"model.layers.0.self_attn.q_proj.bias": torch.ones(64)},
        {},
        "config.json says attention_bias false: the model would serve without it",
    ),
    "an o_proj bias beside attention_bias false": (
        "llama3",
        {"model.layers.1.self_attn.o_proj.bias": torch.ones(64)},
        {},
        "config.json says attention_bias false: the model would serve without it",
    ),
    "a down_proj bias beside mlp_bias false": (
        "llama3",
        {"model.layers.1.mlp.down_proj.bias": torch.ones(64)},
        {},
        "config.json says mlp_bias false: the model would serve without it",
    ),
    "an o_proj bias in a Qwen2, which has none": (
        "qwen2",
        {"model.layers.0.self_attn.o_proj.bias": torch.ones(64)},
        {},
        "config.json says architectures Qwen2ForCausalLM, which has no such weight: the model would serve "
        "without it",
    ),
    "a bias in a Mistral, which has none": (
        "mistral",
        {"model.layers.0.self_attn.k_proj.bias": torch.ones(32)},
        {},
        "config.json says architectures MistralForCausalLM, which has no such weight: the model would "
        "serve without it",
    ),
}


@pytest.mark.parametrize("kind", list(FLAGGED))
def test_a_weight_the_config_turns_off_is_refused_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, kind: str
) -> None:
    """transformers loads such a file, reports the tensor UNEXPECTED and serves without it (vLLM drops
    it in silence): other outputs than the checkpoint's, with no sign of why."""
    variant, added, config, said = FLAGGED[kind]
    model_dir = copy_with(checkpoints[variant], tmp_path, added, **config)
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir, "float32")
    (name,) = added
    assert str(raised.value) == f"{model_dir / 'model.safetensors'}: weight {name} is in the file, but {said}"


# Checkpoints named a Llama whose every shape checks: their own weights alone say the config is wrong.
MISNAMED = {
    # Qwen2's layer is Llama's with q/k/v biases (attention_bias left out, so false).
    "qwen2": (
        "model.layers.0.self_attn.q_proj.bias",
        "config.json says attention_bias false: the model would serve without it",
    ),
    "qwen3": (
        "model.layers.0.self_attn.q_norm.weight",
        "config.json says architectures LlamaForCausalLM, which has no such weight: the model would "
        "serve without it",
    ),
}


@pytest.mark.parametrize("variant", list(MISNAMED))
def test_a_checkpoint_named_a_llama_is_refused_at_its_first_weight_a_llama_has_not(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, variant: str
) -> None:
    model_dir = copy_with(
        checkpoints[variant], tmp_path, {}, architectures=["LlamaForCausalLM"], model_type="llama"
    )
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir, "float32")
    name, said = MISNAMED[variant]
    assert str(raised.value) == f"{model_dir / 'model.safetensors'}: weight {name} is in the file, but {said}"


def test_a_head_of_its_own_beside_a_tied_config_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """transformers 5 then unties the head and reads the file's (warning that the config should say
    tie_word_embeddings false), vLLM ties it and ignores the file's: served tied, the outputs would be
    neither the checkpoint author's nor transformers'."""
    qwen3 = checkpoints["qwen3"]
    head = torch.randn(qwen3.hf_model.config.vocab_size, qwen3.hf_model.config.hidden_size)
    model_dir = copy_with(qwen3, tmp_path, {"lm_head.weight": head})
    with pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir, "float32")
    assert str(raised.value) == (
        f"{model_dir / 'model.safetensors'}: weight lm_head.weight differs from model.embed_tokens.weight, "
        "but config.json says tie_word_embeddings true: the head would read the token table, not this weight"
    )


def test_a_head_equal_to_the_token_table_beside_a_tied_config_is_named_and_loads_tied(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Some exports save the tied table twice; transformers ties them in silence, with the same outputs."""
    qwen3 = checkpoints["qwen3"]
    table = load_file(qwen3.path / "model.safetensors")["model.embed_tokens.weight"]
    model_dir = copy_with(qwen3, tmp_path, {"lm_head.weight": table.clone()})
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.check_checkpoint(model_dir, "float32")
    assert [r.getMessage() for r in caplog.records] == [
        f"{model_dir / 'model.safetensors'}: weight lm_head.weight is not read: config.json says "
        "tie_word_embeddings true, and it equals model.embed_tokens.weight, which the head reads"
    ]
    assert load_model(model_dir, dtype="float32").model.lm_head is None


def test_weights_no_config_would_read_are_one_warning_line_and_the_model_loads(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers reports such weights unexpected and serves without them; the warning counts them and
    names the first few."""
    llama3 = checkpoints["llama3"]
    added = {f"model.extra.{i}.weight": torch.ones(2) for i in range(4)}
    model_dir = copy_with(llama3, tmp_path, added)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.check_checkpoint(model_dir, "float32")
    (warning,) = [r.getMessage() for r in caplog.records]
    match = re.fullmatch(
        r"4 weights in the checkpoint are not read by LlamaForCausalLM: (.*), \.\.\.", warning
    )
    assert match is not None, warning
    named = match.group(1).split(", ")
    assert len(named) == MAX_NAMED_UNREAD and set(named) < set(added)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=loader.__name__):  # said once, before listening
        model = load_model(model_dir, dtype="float32").model
    assert caplog.records == []
    reference = load_model(llama3.path, dtype="float32").model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "qwen3", "mistral"])
def test_the_weights_warned_of_are_those_transformers_reports_unexpected(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, caplog: pytest.LogCaptureFixture, variant: str
) -> None:
    """Older files hold each layer's rotary_emb.inv_freq (and some the model's), a buffer recomputed at
    load: transformers passes them over in silence, so a warning naming them alarmed for nothing."""
    added = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}
    added |= {"model.rotary_emb.inv_freq": torch.ones(8), "model.extra.weight": torch.ones(2)}
    model_dir = copy_with(checkpoints[variant], tmp_path, added)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        config = loader.check_checkpoint(model_dir, "float32")
    warnings = [r.getMessage() for r in caplog.records]
    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == ["model.extra.weight"]
    assert warnings == [
        f"1 weight in the checkpoint is not read by {config.architecture}: model.extra.weight"
    ]


def test_an_fp8_checkpoint_is_refused_in_one_line_before_its_scales_are_warned_of(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An FP8 checkpoint stores each projection as float8_e4m3fn beside its scales, which the model
    does not read: the start-up warned of the scales, listened, then refused the first projection."""
    llama3 = checkpoints["llama3"]
    weights = load_file(llama3.path / "model.safetensors")
    projections = [name for name in weights if name.endswith("_proj.weight")]
    added = {name: weights[name].to(torch.float8_e4m3fn) for name in projections}
    added |= {name.replace(".weight", ".weight_scale"): torch.ones(1) for name in projections}
    added |= {name.replace(".weight", ".input_scale"): torch.ones(1) for name in projections}
    model_dir = copy_with(llama3, tmp_path, added)
    with caplog.at_level(logging.WARNING, logger=loader.__name__), pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir, "float32")
    assert caplog.records == []
    assert str(raised.value) == (
        f"{model_dir / 'model.safetensors'}: weight model.layers.0.self_attn.q_proj.weight is stored as "
        "F8_E4M3, not a type a weight is read from (supported: BF16, F16, F32, F64)"
    )


def test_an_fp8_checkpoint_is_refused_naming_its_quantization_config_s_method(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its config.json says which quantization wrote it: the refusal names that, and what Tandem
    serves instead, where it named the first e4m3 tensor."""
    llama3 = checkpoints["llama3"]
    weights = load_file(llama3.path / "model.safetensors")
    projections = [name for name in weights if name.endswith("_proj.weight")]
    added = {name: weights[name].to(torch.float8_e4m3fn) for name in projections}
    added |= {name.replace(".weight", ".weight_scale"): torch.ones(1) for name in projections}
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    model_dir = copy_with(llama3, tmp_path, added, quantization_config=fp8)
    with caplog.at_level(logging.WARNING, logger=loader.__name__), pytest.raises(ModelLoadError) as raised:
        loader.check_checkpoint(model_dir, "float32")
    assert caplog.records == []
    assert str(raised.value) == (
        f"{model_dir / 'config.json'}: quantization_config.quant_method is 'fp8': the weights are stored "
        "for that quantization's own loader, which Tandem has not. Serve the bf16, fp16 or fp32 checkpoint "
        "it was quantized from, with --quantization int8 or int4 to quantize at load, or a GGUF file with "
        "--quantization gguf (docs/DEPLOYMENT.md)"
    )


def test_float_weights_beside_a_quantization_config_are_refused_naming_the_field(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """bitsandbytes quantizes float weights as its loader reads them: every header passes, and the
    checkpoint loaded as another model than its config describes."""
    quantization = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    model_dir = copy_with(checkpoints["qwen3"], tmp_path, {}, quantization_config=quantization)
    said = r"config\.json: quantization_config\.quant_method is 'bitsandbytes': the weights are stored"
    with pytest.raises(ModelLoadError, match=said):
        loader.check_checkpoint(model_dir, "float32")
    with pytest.raises(ModelLoadError, match=said):
        load_model(model_dir, dtype="float32")


def test_a_checkpoint_holding_just_what_its_config_reads_gets_no_warning(
    checkpoint: Checkpoint, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.check_checkpoint(checkpoint.path, "float32")
    assert caplog.records == []


def test_the_heads_comparison_reads_every_block_of_rows_and_compares_values_across_dtypes(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head that differs in its last row alone is refused, read 100 rows at a time; a table stored
    in bfloat16 beside a head holding the same values in float32 is the same table."""
    monkeypatch.setattr(checkpoint_shapes, "_HEAD_ROWS_PER_READ", 100)
    qwen3 = checkpoints["qwen3"]
    table = load_file(qwen3.path / "model.safetensors")["model.embed_tokens.weight"].to(torch.bfloat16)
    head = table.float()
    model_dir = copy_with(qwen3, tmp_path, {"model.embed_tokens.weight": table, "lm_head.weight": head})
    loader.check_checkpoint(model_dir, "float32")
    head[-1, -1] += 1  # in another directory: a process remembers a file's verdict until it is written anew
    other_dir = copy_with(
        qwen3, tmp_path / "other", {"model.embed_tokens.weight": table, "lm_head.weight": head}
    )
    with pytest.raises(ModelLoadError, match="weight lm_head.weight differs from model.embed_tokens.weight"):
        loader.check_checkpoint(other_dir, "float32")


def test_a_head_differing_from_the_table_only_in_the_sign_of_a_zero_is_the_same_table(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """-0.0 and 0.0 are one value (every product with them is): the same dtype's bytes differ, the
    values do not, so the checkpoint loads tied as it does across dtypes."""
    qwen3 = checkpoints["qwen3"]
    table = load_file(qwen3.path / "model.safetensors")["model.embed_tokens.weight"].to(torch.bfloat16)
    table[0, 0] = 0.0
    head = table.clone()
    head[0, 0] = -0.0
    model_dir = copy_with(qwen3, tmp_path, {"model.embed_tokens.weight": table, "lm_head.weight": head})
    loader.check_checkpoint(model_dir, "float32")


def test_a_process_compares_a_tied_head_with_its_table_once_per_file(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check_checkpoint before listening and load_model after it each compared the two tables (0.69 s
    for Qwen2.5-0.5B's bf16 pair); the file written anew, whose head now differs, is compared again."""
    qwen3 = checkpoints["qwen3"]
    table = load_file(qwen3.path / "model.safetensors")["model.embed_tokens.weight"]
    model_dir = copy_with(qwen3, tmp_path, {"lm_head.weight": table.clone()})
    compared = []
    same_table = checkpoint_shapes._same_table

    def counted(*args: Any) -> bool:
        compared.append(args[1])
        return same_table(*args)

    monkeypatch.setattr(checkpoint_shapes, "_same_table", counted)
    loader.check_checkpoint(model_dir, "float32")
    assert load_model(model_dir, dtype="float32").model.lm_head is None
    assert compared == ["lm_head.weight"]
    # Stored in bfloat16 the file is smaller: written anew, whatever the clock's resolution.
    head = (table + 1).to(torch.bfloat16)
    path = model_dir / "model.safetensors"
    save_file(load_file(path) | {"lm_head.weight": head}, path)
    with pytest.raises(ModelLoadError, match="weight lm_head.weight differs from model.embed_tokens.weight"):
        loader.check_checkpoint(model_dir, "float32")
    assert compared == ["lm_head.weight", "lm_head.weight"]


def test_a_file_replaced_while_its_tables_are_compared_is_compared_again(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open file's bytes are compared, which a file replaced after the open no longer holds: its
    verdict was filed under the new file's stamp, so the new file, whose head differs, was served tied
    on the old one's verdict."""
    qwen3 = checkpoints["qwen3"]
    table = load_file(qwen3.path / "model.safetensors")["model.embed_tokens.weight"]
    model_dir = copy_with(qwen3, tmp_path, {"lm_head.weight": table.clone()})
    path = model_dir / "model.safetensors"
    differing = tmp_path / "differing.safetensors"
    save_file(load_file(path) | {"lm_head.weight": table + 1}, differing)
    safe_open = safetensors_weights.safe_open

    def replaced_once_open(*args: Any, **kwargs: Any) -> Any:
        handle = safe_open(*args, **kwargs)
        if differing.exists():
            differing.replace(path)  # a new file (another inode) at the path the open one came from
        return handle

    monkeypatch.setattr(safetensors_weights, "safe_open", replaced_once_open)
    loader.check_checkpoint(model_dir, "float32")  # the open file's head equals its table
    monkeypatch.setattr(safetensors_weights, "safe_open", safe_open)
    with pytest.raises(ModelLoadError, match="weight lm_head.weight differs from model.embed_tokens.weight"):
        loader.check_checkpoint(model_dir, "float32")


DIFFERS = "weight lm_head.weight differs from model.embed_tokens.weight"


def _tied_and_differing(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> tuple[Path, Path, Path]:
    """A checkpoint whose head equals its table, its file's path, and another file whose head differs."""
    qwen3 = checkpoints["qwen3"]
    table = load_file(qwen3.path / "model.safetensors")["model.embed_tokens.weight"]
    model_dir = copy_with(qwen3, tmp_path, {"lm_head.weight": table.clone()})
    path = model_dir / "model.safetensors"
    differing = tmp_path / "differing.safetensors"
    save_file(load_file(path) | {"lm_head.weight": table + 1}, differing)
    return model_dir, path, differing


def test_a_file_replaced_between_its_stamp_and_its_open_is_not_judged_by_the_verdict_on_file(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp read before the open names the old file, whose verdict is on file: the file opened is
    the new one, compared again, since its path no longer stats as the stamp."""
    model_dir, path, differing = _tied_and_differing(checkpoints, tmp_path)
    loader.check_checkpoint(model_dir, "float32")  # the verdict "same" filed under the file's stamp
    safe_open = safetensors_weights.safe_open

    def replaced_before_open(*args: Any, **kwargs: Any) -> Any:
        if differing.exists():
            differing.replace(path)  # after the stamp, before the open
        return safe_open(*args, **kwargs)

    monkeypatch.setattr(safetensors_weights, "safe_open", replaced_before_open)
    with pytest.raises(ModelLoadError, match=DIFFERS):
        loader.check_checkpoint(model_dir, "float32")


def test_a_verdict_on_a_file_replaced_before_its_open_is_not_filed_under_the_old_stamp(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file opened is not the one stamped: its verdict ("same") says nothing of the stamped file,
    whose head differs, and would pass that file were its stamp seen again."""
    model_dir, path, differing = _tied_and_differing(checkpoints, tmp_path)
    same = tmp_path / "same.safetensors"
    path.replace(same)
    differing.replace(path)
    stamped = checkpoint_shapes.FileStamp.of(path)
    safe_open = safetensors_weights.safe_open

    def replaced_before_open(*args: Any, **kwargs: Any) -> Any:
        if same.exists():
            same.replace(path)
        return safe_open(*args, **kwargs)

    monkeypatch.setattr(safetensors_weights, "safe_open", replaced_before_open)
    loader.check_checkpoint(model_dir, "float32")  # the file opened, `same`, is judged
    assert not [memo for memo in checkpoint_shapes._same_tables if stamped in (memo[0], memo[2])]


def test_a_symlink_flipped_around_the_open_is_judged_by_the_file_its_stamp_names(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlinked file, as Hugging Face's cache holds them, pointing at a file whose head differs,
    retargeted at a tied one before the open and back before the comparison's second stat: the path
    stats as its stamp both times, so the tied file's verdict was filed under the differing one's
    stamp, and passed it then and on every later check."""
    model_dir, path, differing = _tied_and_differing(checkpoints, tmp_path)
    same = tmp_path / "same.safetensors"
    path.replace(same)
    path.symlink_to(differing)
    safe_open = safetensors_weights.safe_open

    def flipped_around_open(*args: Any, **kwargs: Any) -> Any:
        path.unlink()
        path.symlink_to(same)
        handle = safe_open(*args, **kwargs)
        path.unlink()
        path.symlink_to(differing)
        return handle

    monkeypatch.setattr(safetensors_weights, "safe_open", flipped_around_open)
    with pytest.raises(ModelLoadError, match=DIFFERS):
        loader.check_checkpoint(model_dir, "float32")
    monkeypatch.setattr(safetensors_weights, "safe_open", safe_open)
    with pytest.raises(ModelLoadError, match=DIFFERS):
        loader.check_checkpoint(model_dir, "float32")


def test_a_stamp_names_the_file_its_numbers_are_of_when_a_symlink_is_retargeted_between_its_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stamp stats the file its path resolves to: stating the link, then resolving it, a link
    retargeted between the two gave one file's path with the other's inode, size and times."""
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    first.write_bytes(b"first")
    second.write_bytes(b"the second")
    link = tmp_path / "model.safetensors"
    link.symlink_to(first)
    stat = Path.stat

    def retargeted_after_the_first_stat(self: Path, **kwargs: Any) -> Any:
        result = stat(self, **kwargs)
        if link.readlink() == first:
            link.unlink()
            link.symlink_to(second)
        return result

    monkeypatch.setattr(Path, "stat", retargeted_after_the_first_stat)
    stamp = checkpoint_shapes.FileStamp.of(link)
    monkeypatch.setattr(Path, "stat", stat)
    assert (stamp.inode, stamp.size) == (stamp.path.stat().st_ino, stamp.path.stat().st_size)
