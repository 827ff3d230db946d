"""Reading PEFT adapters without peft: what is kept, and every refusal naming its file and field."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.decoder.tests.lora_adapters import SPECS, make_adapter
from tandem.client.errors import InvalidArgument
from tandem.decoder.models.adapter_root import AdapterRoot
from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    max_weights_bytes,
    read_adapter,
)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("mlp8"), SPECS["mlp8"], seed=1)


def copy_with(adapter_dir: Path, out: Path, **settings: object) -> Path:
    out.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text()) | settings
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    return out


def test_an_adapter_keeps_peft_s_tensors_rank_targets_and_rslora_scale(
    adapter_dir: Path, tiny_fp32: LoadedModel
) -> None:
    adapter = read_adapter(adapter_dir, tiny_fp32.config, max_rank=16)
    assert adapter.rank == 8 and adapter.targets == ("k_proj", "o_proj", "up_proj", "down_proj")
    assert adapter.scale == pytest.approx(16.0 / math.sqrt(8))  # use_rslora
    assert len(adapter.weights) == 4 * tiny_fp32.config.num_layers
    from safetensors import safe_open

    with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
        a = f.get_tensor("base_model.model.model.layers.2.mlp.up_proj.lora_A.weight")
        b = f.get_tensor("base_model.model.model.layers.2.mlp.up_proj.lora_B.weight")
    got_a, got_b = adapter.weights[(2, "up_proj")]
    assert torch.equal(got_a, a) and torch.equal(got_b, b) and b.abs().sum() > 0


@pytest.mark.parametrize(
    ("settings", "field", "says"),
    [
        ({"r": 32}, "adapter_config.json:r", "more than the server's --max-lora-rank 16"),
        ({"use_dora": True}, "adapter_config.json:use_dora", "DoRA"),
        ({"bias": "all"}, "adapter_config.json:bias", "must be 'none'"),
        ({"modules_to_save": ["lm_head"]}, "adapter_config.json:modules_to_save", "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "adapter_config.json:target_modules", "'lm_head'"),
        ({"peft_type": "IA3"}, "adapter_config.json:peft_type", "must be LORA"),
        ({"alora_invocation_tokens": [17, 402]}, "adapter_config.json:alora_invocation_tokens", "aLoRA"),
        ({"layer_replication": [[0, 1], [0, 1]]}, "adapter_config.json:layer_replication", "not supported"),
        ({"target_modules": r".*_(proj|head)"}, "adapter_config.json:target_modules", "names lm_head"),
    ],
)
def test_settings_the_server_cannot_honour_are_refused_naming_the_field(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, settings: dict, field: str, says: str
) -> None:
    with pytest.raises(AdapterError, match=says) as raised:
        read_adapter(copy_with(adapter_dir, tmp_path / "a", **settings), tiny_fp32.config, max_rank=16)
    assert raised.value.field == field


def test_a_tensor_for_another_base_model_is_refused_naming_it(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    out = copy_with(adapter_dir, tmp_path / "a", r=4, target_modules=["q_proj"])
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file(
        {name.format("A"): torch.ones(4, 32), name.format("B"): torch.ones(64, 4)},
        out / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match=r"has shape \[4, 32\], expected \[4, 64\]") as raised:
        read_adapter(out, tiny_fp32.config, max_rank=16)
    assert raised.value.field == f"adapter_model.safetensors:{name.format('A')}"


@pytest.mark.parametrize(
    ("tensors", "says"),
    [
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)}, "no lora_B"),
        ({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)}, "layer 9"),
        ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 64)}, "is not a LoRA weight"),
        # Names no module of the base model has, which PEFT would not load: "layers.00." was read as
        # layer 0 (the later of the two tensors served), "self_attn.up_proj" as mlp.up_proj, and a
        # layer of 5,000 digits failed int() (INTERNAL).
        (
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
                "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                "base_model.model.model.layers.00.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
            },
            "layers.00.self_attn.q_proj.lora_A.weight: is not a LoRA weight",
        ),
        (
            {
                "base_model.model.model.layers.0.self_attn.up_proj.lora_A.weight": torch.ones(4, 64),
                "base_model.model.model.layers.0.self_attn.up_proj.lora_B.weight": torch.ones(192, 4),
            },
            "self_attn.up_proj.lora_A.weight: is not a LoRA weight",
        ),
        (
            {f"base_model.model.model.layers.{'9' * 5000}.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)},
            "is not a LoRA weight",
        ),
        (
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full(
                    (4, 64), math.nan
                ),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
            },
            "finite",
        ),
    ],
)
def test_tensors_that_do_not_make_an_adapter_are_refused(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, tensors: dict, says: str
) -> None:
    out = copy_with(adapter_dir, tmp_path / "a", r=4, target_modules="all-linear")
    save_file(tensors, out / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=says):
        read_adapter(out, tiny_fp32.config, max_rank=16)


@pytest.mark.parametrize(
    ("settings", "tensor", "says"),
    [
        # peft builds layers only for the modules these name, and loads no other tensor: the decoder
        # served the file's every tensor, other tokens than peft's with no error.
        ({"target_modules": ["k_proj", "o_proj", "up_proj"]}, "0.mlp.down_proj.lora_A", "target_modules"),
        ({"exclude_modules": ["o_proj"]}, "0.self_attn.o_proj.lora_A", "exclude_modules"),
        ({"layers_to_transform": [1]}, "0.mlp.down_proj.lora_A", "layers_to_transform"),
        ({"target_modules": r".*\.(k_proj|o_proj|up_proj)"}, "0.mlp.down_proj.lora_A", "target_modules"),
        (
            {"exclude_modules": r"model\.layers\.0\.self_attn\..*"},
            "0.self_attn.k_proj.lora_A",
            "exclude_modules",
        ),
    ],
)
def test_a_tensor_peft_would_not_load_is_refused_naming_it_and_the_setting(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, settings: dict, tensor: str, says: str
) -> None:
    with pytest.raises(AdapterError, match=f"adapter_config.json:{says} ") as raised:
        read_adapter(copy_with(adapter_dir, tmp_path / "a", **settings), tiny_fp32.config, max_rank=16)
    assert raised.value.field == f"adapter_model.safetensors:base_model.model.model.layers.{tensor}.weight"


def test_all_linear_dotted_names_patterns_and_lists_for_other_models_adapt_what_the_file_holds(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    listed = read_adapter(adapter_dir, tiny_fp32.config, max_rank=16)
    for i, targets in enumerate(
        [
            "all-linear",  # with init_lora_weights true below: peft leaves q, v and gate as the base's
            ["self_attn.k_proj", "o_proj", "mlp.up_proj", "down_proj"],
            r"model\.layers\.\d+\.(self_attn|mlp)\.(k|o|up|down)_proj",
            ["k_proj", "o_proj", "up_proj", "down_proj", "W_pack", "query_key_value", "c_attn"],
        ]
    ):
        out = copy_with(adapter_dir, tmp_path / str(i), target_modules=targets, init_lora_weights=True)
        got = read_adapter(out, tiny_fp32.config, 16)
        assert got.targets == listed.targets and got.weights.keys() == listed.weights.keys()


def copy_without(adapter_dir: Path, out: Path, modules: list[str], **settings: object) -> Path:
    """copy_with, its weights file lacking the lora_A and lora_B of `modules` ("1.mlp.up_proj")."""
    copy_with(adapter_dir, out, **settings)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    dropped = {f"base_model.model.model.layers.{m}.lora_{half}.weight" for m in modules for half in "AB"}
    assert dropped <= tensors.keys()
    save_file({k: v for k, v in tensors.items() if k not in dropped}, out / "adapter_model.safetensors")
    return out


# peft 0.21.2 adapts every module adapter_config.json targets, one the file has no tensors for with its
# init's A and B, and only warns of the missing keys. On the tiny model with v_proj of layer 1 left out:
# init_lora_weights false or null (nn.Linear's own random init) moved the logits 0.16 from those of the
# module left unadapted (the whole adapter's effect: 0.29); true, "gaussian" and "eva" (B zero) by 0;
# "orthogonal" (B @ A zero but for rounding, drawn afresh at each load) by 2.6e-7.
@pytest.mark.parametrize("init", [False, None])
def test_a_targeted_module_the_file_lacks_is_refused_where_peft_gives_it_random_weights(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, init: bool | None
) -> None:
    out = copy_without(
        adapter_dir, tmp_path / "a", ["3.mlp.down_proj", "1.mlp.up_proj"], init_lora_weights=init
    )
    with pytest.raises(AdapterError) as raised:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/partial")
    assert raised.value.field == WEIGHTS_FILE
    said = raised.value.description
    assert said.startswith(
        "in team/partial holds no lora_A/lora_B for model.layers.1.mlp.up_proj and 1 more module(s), which "
        f"adapter_config.json:target_modules targets; with init_lora_weights {json.dumps(init)} peft gives "
    )


@pytest.mark.parametrize("init", [True, "gaussian", "eva", "orthogonal", "unset"])
def test_a_targeted_module_the_file_lacks_is_left_as_the_base_model_where_peft_s_init_does_so(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, init: bool | str
) -> None:
    out = copy_without(adapter_dir, tmp_path / "a", ["1.mlp.up_proj"], init_lora_weights=init)
    if init == "unset":  # peft's default: true
        config = json.loads((out / "adapter_config.json").read_text())
        del config["init_lora_weights"]
        (out / "adapter_config.json").write_text(json.dumps(config))
    adapter = read_adapter(out, tiny_fp32.config, max_rank=16)
    assert (1, "up_proj") not in adapter.weights and (2, "up_proj") in adapter.weights
    assert len(adapter.weights) == 4 * tiny_fp32.config.num_layers - 1


@pytest.mark.parametrize(
    ("edit", "field", "says"),
    [
        # Each was INTERNAL at LoadAdapter and a traceback (exit 1) at start.
        ("config", "adapter_config.json:lora_alpha", "over float32's range"),
        ("targets", "adapter_config.json:target_modules", "must be a list of module names"),
        (
            "float8",
            "adapter_model.safetensors:{}",
            "is stored as float8_e4m3fn: must be F16, BF16, F32 or F64",
        ),
        ("int32", "adapter_model.safetensors:{}", "is stored as int32"),
    ],
)
def test_malformed_values_are_refused_naming_the_file_and_field(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, edit: str, field: str, says: str
) -> None:
    out = copy_with(
        adapter_dir, tmp_path / "a", **({"target_modules": [["k_proj"]]} if edit == "targets" else {})
    )
    if edit == "config":  # an integer of 401 digits: json reads it, no float holds it
        text = (out / "adapter_config.json").read_text()
        (out / "adapter_config.json").write_text(
            text.replace('"lora_alpha": 16.0', '"lora_alpha": 1' + "0" * 400)
        )
    tensors = load_file(out / "adapter_model.safetensors")
    if edit in ("float8", "int32"):
        dtype = torch.float8_e4m3fn if edit == "float8" else torch.int32
        save_file({k: v.to(dtype) for k, v in tensors.items()}, out / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=says) as raised:
        read_adapter(out, tiny_fp32.config, max_rank=16)
    assert raised.value.field == field.format(sorted(tensors)[0])


def test_an_update_whose_gain_is_past_the_bound_is_refused_naming_its_tensor(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # lora_alpha 1e30: a finite scale and finite weights, but the hidden states overflowed and every
    # request on the adapter emitted token 0 at logprob -ln(vocab) for ever, with no error.
    loud = copy_with(adapter_dir, tmp_path / "loud", lora_alpha=1e30)
    with pytest.raises(AdapterError, match=r"multiply an input by .* over the 1e\+06") as raised:
        read_adapter(loud, tiny_fp32.config, max_rank=16)
    assert raised.value.field.endswith(".lora_B.weight") and "lora_alpha" in str(raised.value)
    adapter = read_adapter(adapter_dir, tiny_fp32.config, max_rank=16)  # peft's random one: far below
    gain = max(adapter.scale * a.norm() * b.norm() for a, b in adapter.weights.values())
    assert gain < 1e3


def test_a_pickled_adapter_is_never_read(adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path) -> None:
    out = copy_with(adapter_dir, tmp_path / "a")
    (out / "adapter_model.safetensors").rename(out / "adapter_model.bin")
    with pytest.raises(AdapterError, match="adapter_model.bin is a pickle, never read"):
        read_adapter(out, tiny_fp32.config, max_rank=16)
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        read_adapter(tmp_path, tiny_fp32.config, max_rank=16)


def _config_file_holding(adapter_dir: Path, out: Path, content: bytes) -> Path:
    copy_with(adapter_dir, out)
    (out / "adapter_config.json").write_bytes(content)
    return out


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[]", "must hold a JSON object, got list"),
        (b"null", "must hold a JSON object, got NoneType"),
        (b'{"r": "\xff"}', "is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply to read"),
    ],
)
def test_a_config_file_that_is_no_json_object_is_refused_naming_it(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, content: bytes, says: str
) -> None:
    # Each was an AttributeError, UnicodeDecodeError or RecursionError: INTERNAL to a LoadAdapter call.
    out = _config_file_holding(adapter_dir, tmp_path / "a", content)
    with pytest.raises(AdapterError, match=says) as raised:
        read_adapter(out, tiny_fp32.config, max_rank=16)
    assert raised.value.field == "adapter_config.json"


def test_values_that_overflow_once_cast_are_refused_before_any_slot_holds_them(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # Finite in the file, Inf in float32 (or in a float16 model's slots): every request on the adapter
    # sampled token 0 from NaN logits, and a scale over float32 failed on the engine thread mid-install.
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    wide = copy_with(adapter_dir, tmp_path / "wide", r=4, target_modules=["q_proj"])
    save_file(
        {
            name.format("A"): torch.ones(4, 64),
            name.format("B"): torch.full((64, 4), 1e300, dtype=torch.float64),
        },
        wide / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match="beyond float32's or the model's float32 range") as raised:
        read_adapter(wide, tiny_fp32.config, max_rank=16)
    assert raised.value.field == f"adapter_model.safetensors:{name.format('B')}"
    half = copy_with(adapter_dir, tmp_path / "half", r=4, target_modules=["q_proj"])
    save_file(
        {name.format("A"): torch.ones(4, 64), name.format("B"): torch.full((64, 4), 1e30)},
        half / "adapter_model.safetensors",
    )
    # float32 holds 1e30 (the gain bound then refuses it, naming the same tensor)
    with pytest.raises(AdapterError, match="multiply an input by") as raised:
        read_adapter(half, tiny_fp32.config, max_rank=16)
    assert raised.value.field == f"adapter_model.safetensors:{name.format('B')}"
    fp16 = dataclasses.replace(tiny_fp32.config, dtype=torch.float16)
    with pytest.raises(AdapterError, match="the model's float16 range"):
        read_adapter(half, fp16, max_rank=16)
    loud = copy_with(adapter_dir, tmp_path / "loud", lora_alpha=1e300)
    with pytest.raises(AdapterError, match="over float32's range") as raised:
        read_adapter(loud, tiny_fp32.config, max_rank=16)
    assert raised.value.field == "adapter_config.json:lora_alpha"


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("", "must not be empty"),
        ("/tmp/" + "d" * 300, "cannot be read: File name too long"),
        ("/" + "d/" * 2100, "must be at most 4096 bytes, got 4201"),
    ],
)
def test_a_path_that_names_no_readable_directory_is_refused_naming_path(
    tiny_fp32: LoadedModel, path: str, says: str
) -> None:
    with pytest.raises(AdapterError, match=says) as raised:
        read_adapter(path, tiny_fp32.config, max_rank=16)
    assert raised.value.field == "path" and len(raised.value.description) < 200


def test_refusals_name_the_directory_as_shown_never_the_path_opened(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # A LoadAdapter caller under --lora-root sees the path it named, relative to the root.
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "adapter_config.json").write_bytes((adapter_dir / "adapter_config.json").read_bytes())
    (tmp_path / "not-json").mkdir()
    (tmp_path / "not-json" / "adapter_config.json").write_text("{")
    said = []
    for directory in (tmp_path / "empty", config_only, tmp_path / "not-json"):
        directory.mkdir(exist_ok=True)
        with pytest.raises(AdapterError) as refused:
            read_adapter(directory, tiny_fp32.config, max_rank=16, shown="team/x")
        said.append(str(refused.value))
    assert said[0] == "adapter_config.json: adapter_config.json not found in team/x"
    assert said[1] == "adapter_model.safetensors: not found in team/x"
    assert said[2].startswith("adapter_config.json: team/x/adapter_config.json is not valid JSON")
    assert not any(str(tmp_path) in s for s in said)


def test_the_weights_file_is_never_memory_mapped(
    adapter_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mapped file that shrinks under the reader (`cp` over it truncates, then writes) is SIGBUS: the
    # decoder and every stream on it dead. Whatever maps the file, it is mapped while tensors are checked.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    weights = str((adapter_dir / WEIGHTS_FILE).resolve())
    mapped_while_checked = []
    isfinite = torch.isfinite

    def checking(tensor: torch.Tensor) -> torch.Tensor:
        mapped_while_checked.append(weights in maps.read_text())
        return isfinite(tensor)

    monkeypatch.setattr(torch, "isfinite", checking)
    read_adapter(adapter_dir, tiny_fp32.config, max_rank=16)
    assert mapped_while_checked and not any(mapped_while_checked)


@pytest.mark.parametrize("change", ["cut short", "rewritten"])
def test_a_weights_file_changed_while_read_is_refused(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    # What `cp` over an adapter does while a LoadAdapter reads it: truncate, then write.
    out = copy_with(adapter_dir, tmp_path / "a")
    weights = out / WEIGHTS_FILE
    whole = weights.read_bytes()
    inode, os_read = weights.stat().st_ino, os.read

    def change_then_read(fd: int, size: int) -> bytes:  # after the reader's open and fstat
        if os.fstat(fd).st_ino == inode and weights.stat().st_size == len(whole):
            weights.write_bytes(whole[: len(whole) // 2])
            if change == "rewritten":
                time.sleep(0.01)  # a later mtime, whatever the file system's clock tick
                weights.write_bytes(whole[: len(whole) // 2] + bytes(len(whole) - len(whole) // 2))
        return os_read(fd, size)

    monkeypatch.setattr(os, "read", change_then_read)
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
    assert str(refused.value) == (
        "adapter_model.safetensors: changed while it was read (being written?): load team/a once it is whole"
    )


def test_a_same_size_rewrite_that_sets_its_mtime_back_is_refused(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `cp -p` or `rsync --inplace -t` over an adapter being read: truncate, write another adapter of
    # the same size, and set the source's mtime. Size and mtime read back as they were, and the reader
    # kept half of each file's tensors; only the change time, which utime cannot set, tells.
    out = copy_with(adapter_dir, tmp_path / "a")
    weights = out / WEIGHTS_FILE
    save_file({k: v * 2 for k, v in load_file(weights).items()}, tmp_path / "b", metadata={"format": "pt"})
    other, first, os_read = (tmp_path / "b").read_bytes(), weights.stat(), os.read
    assert len(other) == first.st_size
    rewritten = []

    def rewrite_half_way(fd: int, size: int) -> bytes:
        if os.fstat(fd).st_ino != first.st_ino or rewritten:
            return os_read(fd, size)
        rewritten.append(True)
        half = os_read(fd, size // 2)
        weights.write_bytes(other)
        os.utime(weights, ns=(first.st_atime_ns, first.st_mtime_ns))
        while os.stat(weights).st_ctime_ns == first.st_ctime_ns:  # the clock's tick may not have passed
            time.sleep(0.001)
            os.utime(weights, ns=(first.st_atime_ns, first.st_mtime_ns))
        return half

    monkeypatch.setattr(os, "read", rewrite_half_way)
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
    assert str(refused.value) == (
        "adapter_model.safetensors: changed while it was read (being written?): load team/a once it is whole"
    )
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (first.st_size, first.st_mtime_ns)


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_fifo_swapped_in_for_a_file_is_refused_without_blocking(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Swapped in after any check the reader makes (is_file stands for them): its open or read waited
    # for a writer for ever, holding the one adapter-reader thread, every later load and the exit.
    out = copy_with(adapter_dir, tmp_path / "a")
    (out / name).unlink()
    os.mkfifo(out / name)
    monkeypatch.setattr(Path, "is_file", lambda self: True)
    said: list[str] = []

    def load() -> None:
        try:
            read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
        except AdapterError as error:
            said.append(str(error))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # the old reader: give it its EOF, so nothing is left blocked
        os.close(os.open(out / name, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
        pytest.fail(f"reading {name} blocked on a FIFO")
    assert said == [f"{name}: must be a regular file in team/a"]


def test_a_file_gone_after_the_checks_is_refused_without_the_server_s_path(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An operator's unlink-and-recreate during a load: safetensors' own error named the absolute path.
    out = copy_with(adapter_dir, tmp_path / "a")
    (out / WEIGHTS_FILE).unlink()
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # it was there when checked
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
    assert str(refused.value) == "adapter_model.safetensors: not found in team/a"


def test_a_weights_file_larger_than_any_adapter_of_its_rank_is_refused_unread(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # Read whole into memory, a file of any size would be the decoder's memory: bounded by r and the
    # base model (float64 tensors for every module of every layer, and a header).
    out = copy_with(adapter_dir, tmp_path / "a")
    most = max_weights_bytes(tiny_fp32.config, rank=8)
    os.truncate(out / WEIGHTS_FILE, most + 1)  # sparse: nothing written
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16)
    assert refused.value.field == WEIGHTS_FILE
    assert refused.value.description == (
        f"has {most + 1:,} bytes, more than the {most:,} an adapter of r 8 for this base model can hold"
    )


def test_the_pickle_hint_says_the_same_whatever_its_name_leads_to(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # A symlink named adapter_model.bin told whether the file it names, anywhere, exists.
    said = []
    for target in (tmp_path / "exists", tmp_path / "missing"):
        out = copy_with(adapter_dir, tmp_path / f"to-{target.name}")
        (out / WEIGHTS_FILE).unlink()
        (tmp_path / "exists").write_text("")
        (out / "adapter_model.bin").symlink_to(target)
        with pytest.raises(AdapterError) as refused:
            read_adapter(out, tiny_fp32.config, max_rank=16, shown="x")
        said.append(str(refused.value))
    assert (
        said
        == [
            "adapter_model.safetensors: not found in x "
            "(adapter_model.bin is a pickle, never read: save it as safetensors)"
        ]
        * 2
    )


def test_a_resolved_directory_swapped_for_a_symlink_is_refused_not_followed(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # LoadAdapter's directory was resolved inside --lora-root: a symlink there at the read was swapped
    # in since by a writer of the root, and followed it read whatever it leads to (1 load in 400).
    root = tmp_path / "root"
    root.mkdir()
    found = AdapterRoot(root).find(copy_with(adapter_dir, root / "racedir").name)
    (root / "racedir").rename(root / "aside")
    (root / "racedir").symlink_to(adapter_dir)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert (
        str(refused.value)
        == "path: racedir is not a directory (adapter_config.json + adapter_model.safetensors)"
    )
    read_adapter(root / "racedir", tiny_fp32.config, max_rank=16)  # an operator's --lora: followed


def hf_cache_root(adapter_dir: Path, root: Path) -> Path:
    """A root holding the adapter as the Hugging Face cache lays it out: a snapshot's files are symlinks
    into blobs/."""
    repo = root / "models--team--mlp8"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    for blob, name in enumerate((CONFIG_FILE, WEIGHTS_FILE)):
        (repo / "blobs" / str(blob)).write_bytes((adapter_dir / name).read_bytes())
        (repo / "snapshots" / "abc" / name).symlink_to(f"../../blobs/{blob}")
    return root


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_file_swapped_for_a_symlink_leading_out_after_find_is_refused_unread(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, name: str
) -> None:
    # A writer of --lora-root swaps a file for a symlink to one outside after find checked that every
    # name resolves inside: followed, the reader read it and echoed its values ('r: must be a positive
    # integer, got <the outside file's>'). The symlinks into blobs/ that find saw are still read.
    root = hf_cache_root(adapter_dir, tmp_path / "root")
    snapshot = "models--team--mlp8/snapshots/abc"
    found = AdapterRoot(root).find(snapshot)
    read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    outside = copy_with(adapter_dir, tmp_path / "outside", r="SECRET")
    (root / snapshot / name).unlink()
    (root / snapshot / name).symlink_to(outside / name)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert str(refused.value) == (
        f"{name}: changed while it was read (being written?): load {snapshot} once it is whole"
    )


def test_a_file_that_appeared_after_find_is_refused_unread(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # find vouched for no file by that name: one there now was put there since, from anywhere.
    root = tmp_path / "root"
    (root / "team").mkdir(parents=True)
    copy_with(adapter_dir, root / "team" / "a")
    (root / "team" / "a" / WEIGHTS_FILE).rename(tmp_path / WEIGHTS_FILE)
    found = AdapterRoot(root).find("team/a")
    (tmp_path / WEIGHTS_FILE).rename(root / "team" / "a" / WEIGHTS_FILE)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert str(refused.value) == (
        f"{WEIGHTS_FILE}: changed while it was read (being written?): load team/a once it is whole"
    )


@pytest.mark.parametrize("code", [errno.ENOTDIR, errno.ELOOP, errno.EMLINK])
def test_a_symlink_refused_by_the_directory_s_open_is_not_a_directory_on_every_system(
    adapter_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    # O_DIRECTORY | O_NOFOLLOW on a symlink: ENOTDIR on Linux, ELOOP on macOS, EMLINK on FreeBSD.
    os_open = os.open

    def refusing(path: str | Path, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_DIRECTORY:
            raise OSError(code, os.strerror(code))
        return os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(AdapterError) as refused:
        read_adapter(adapter_dir, tiny_fp32.config, max_rank=16, shown="racedir")
    assert (
        str(refused.value)
        == "path: racedir is not a directory (adapter_config.json + adapter_model.safetensors)"
    )


# The calls by which find asks the file system about a path; the race test swaps a directory for a symlink
# leading out during each of them in turn.
_PATH_CALLS = [
    (os, "open"),
    (os, "stat"),
    (os, "lstat"),
    (os, "readlink"),
    (os, "access"),
    (os.path, "realpath"),
]


@pytest.mark.parametrize("swapped", ["team", "team/mlp8"])
def test_a_directory_swapped_for_a_symlink_leading_out_during_find_then_before_the_read_is_never_followed(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str
) -> None:
    # A writer of --lora-root swaps the adapter's directory, or one above it, for a symlink to a copy
    # outside whose config holds r "SECRET", for the length of one of find's steps (each in turn), and
    # back, then again before the read. find resolved a file's path, then took its identity by that path,
    # through the symlink: it vouched for the outside file, and the read, which opened the directory by
    # its path, read it and echoed 'adapter_config.json:r: must be a positive integer, got 'SECRET''.
    outside = tmp_path / "outside"
    outside.mkdir()
    copy_with(adapter_dir, outside / "mlp8", r="SECRET")
    root = tmp_path / "root"
    (root / "team").mkdir(parents=True)
    copy_with(adapter_dir, root / "team" / "mlp8")
    adapters = AdapterRoot(root)

    def swap_out() -> None:
        (root / swapped).rename(root / "aside")
        (root / swapped).symlink_to(outside if swapped == "team" else outside / "mlp8")

    def swap_back() -> None:
        (root / swapped).unlink()
        (root / "aside").rename(root / swapped)

    def swapping_during(step: int, calls: list[int], real: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            calls[0] += 1
            if calls[0] != step:
                return real(*args, **kwargs)
            swap_out()
            try:
                return real(*args, **kwargs)
            finally:
                swap_back()

        return call

    said = set()
    num_calls, step = 0, 0
    while step <= num_calls:  # step 0 counts find's calls and swaps during none
        calls = [0]  # find's calls so far, of every kind in _PATH_CALLS
        try:
            with monkeypatch.context() as patched:
                for module, name in _PATH_CALLS:
                    patched.setattr(module, name, swapping_during(step, calls, getattr(module, name)))
                found = adapters.find("team/mlp8")
            swap_out()
            try:
                read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
            finally:
                swap_back()
            said.add("loaded")
        except InvalidArgument as refused:
            said.add(str(refused))
        num_calls = max(num_calls, calls[0])
        step += 1
    assert num_calls > 0 and not any("SECRET" in s for s in said), said


def test_a_caller_s_path_loads_whatever_the_length_of_the_server_s_and_whatever_its_bytes(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # The read checked the server's path, the root's and all, against PATH_MAX: a valid adapter under a
    # long root was refused ('path: must be at most 4096 bytes, got 5145', telling the root's length),
    # and a directory name in no encoding, reached by a symlink, failed to encode (INTERNAL).
    root = tmp_path.joinpath(*["r" * 200] * 5)  # 1,000 bytes and more, the adapter's 3,200 below it
    root.mkdir(parents=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(16):
        os.mkdir("d" * 199, dir_fd=fd)
        fd, parent = os.open("d" * 199, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(parent)
    os.mkdir(b"\xff", dir_fd=fd)
    for directory in (b"", b"\xff/"):  # the deep directory's own adapter, and one in a name not UTF-8
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            file = os.open(directory + name.encode(), os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.write(file, (adapter_dir / name).read_bytes())
            os.close(file)
    os.close(fd)
    deep = "/".join(["d" * 199] * 16)
    os.symlink(f"{deep}/".encode() + b"\xff", os.path.join(os.fsencode(root), b"latest"))
    for path in (deep, "latest"):
        found = AdapterRoot(root).find(path)
        adapter = read_adapter(
            found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found
        )
        assert adapter.rank == 8


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_adapter_file_find_saw_is_no_regular_file_is_refused_unopened(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Opened to be checked, a device acts on its open (a tape rewinds, a terminal may become the
    # server's own); what find saw stand there is refused by its type before any open, and every open
    # is O_NOCTTY (a terminal swapped in meanwhile never becomes the server's).
    root = tmp_path / "root"
    root.mkdir()
    out = copy_with(adapter_dir, root / "a")
    (out / CONFIG_FILE).unlink()
    os.mkfifo(out / CONFIG_FILE) if kind == "fifo" else (out / CONFIG_FILE).mkdir()
    found = AdapterRoot(root).find("a")
    opened: list[tuple[object, int]] = []
    os_open = os.open

    def recording_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        opened.append((path, flags))
        return os_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", recording_open)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert str(refused.value) == f"{CONFIG_FILE}: must be a regular file in a"
    assert [path for path, _ in opened] == ["a"]  # the directory only
    (out / CONFIG_FILE).unlink() if kind == "fifo" else (out / CONFIG_FILE).rmdir()
    (out / CONFIG_FILE).write_bytes((adapter_dir / CONFIG_FILE).read_bytes())
    opened.clear()
    found = AdapterRoot(root).find("a")
    read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    files = [flags for path, flags in opened if path in (CONFIG_FILE, WEIGHTS_FILE)]
    assert len(files) == 2 and all(flags & os.O_NOCTTY for flags in files)
