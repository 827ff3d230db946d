"""Reading PEFT adapters without peft: what is kept, and every refusal naming its file and field."""

from __future__ import annotations

import dataclasses
import errno
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.client.errors import InvalidArgument
from tandem.decoder.models.adapter_root import AdapterRoot
from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter
from tandem.decoder.models.peft_weights import max_weights_bytes

from .peft_copies import copy_with


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
