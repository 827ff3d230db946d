"""`--lora`, `--enable-lora`, `--lora-root`: what cannot be served with adapters is one line naming the
flag and exit 2, before a port is opened; an adapter that does not fit fails the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.decoder.tests.lora_adapters import SPECS, make_adapter
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("qv4"), SPECS["qv4"], seed=0)


def test_lora_turns_adapters_on_and_names_each(environ, tiny_model_dir: Path, adapter: Path) -> None:
    config = config_from_args(
        ["--model", str(tiny_model_dir), "--lora", f"qv4={adapter}", "--max-loras", "2"]
    )
    assert config.engine.enable_lora and config.engine.loras == (("qv4", adapter),)
    assert not config_from_args(["--model", str(tiny_model_dir)]).engine.enable_lora
    # Several ranks each hold their shard of every slot (tests/distributed/test_lora_ranks.py).
    ranks = config_from_args(
        ["--model", str(tiny_model_dir), "--lora", f"qv4={adapter}", "--world-size", "2"]
    )
    assert ranks.world_size == 2 and ranks.engine.enable_lora


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--static-shapes", "true", "--compile", "true"],
            "--enable-lora (TANDEM_ENABLE_LORA) needs --compile off on the CPU "
            "(the compiled decode buckets take no adapters)",
        ),
        (
            ["--device", "cuda"],
            "--enable-lora (TANDEM_ENABLE_LORA) needs --device cpu or an XLA device such as neuron "
            "(its graphs add every slot's delta), got 'cuda'",
        ),
        (["--enable-lora", "false"], "--lora (TANDEM_LORA) needs --enable-lora true"),
        (["--max-loras", "0"], "--max-loras (TANDEM_MAX_LORAS) must be in [1, 256], got 0"),
    ],
)
def test_settings_adapters_cannot_run_with_are_refused_in_one_line(
    environ,
    flags: list[str],
    said: str,
    tiny_model_dir: Path,
    adapter: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--lora", f"qv4={adapter}", *flags]
    assert decoder_main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [f"tandem serve decoder: {said}"]


def test_an_adapter_that_does_not_fit_fails_before_listening(
    environ, tiny_model_dir: Path, adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 8}))
    (big / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    for value, said in (
        (
            f"big={big}",
            "adapter 'big': adapter_config.json:r: 64 is more than the server's --max-lora-rank 16",
        ),
        (str(adapter), f"must be NAME=PATH, got '{adapter}'"),
    ):
        assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", "--lora", value]) == 2
        assert said in capsys.readouterr().err


def test_lora_root_is_set_by_the_flag_or_its_variable_and_turns_adapters_on(
    environ, tiny_model_dir: Path, tmp_path: Path
) -> None:
    def engine_of(*argv: str):
        return config_from_args(["--model", str(tiny_model_dir), *argv]).engine

    assert engine_of().lora_root is None
    assert engine_of("--lora-root", str(tmp_path)).lora_root == tmp_path
    environ({"TANDEM_LORA_ROOT": str(tmp_path)})
    engine = engine_of()
    assert engine.lora_root == tmp_path and engine.enable_lora
    environ({"TANDEM_LORA_ROOT": ""})
    assert engine_of().lora_root is None


@pytest.mark.parametrize(
    ("root", "flags", "said"),
    [
        ("missing", [], "must be a directory, got '{root}' (nothing is there)"),
        ("file", [], "must be a directory, got '{root}' (it is not a directory)"),
        ("dir", ["--enable-lora", "false"], "needs --enable-lora true"),
        # Path('') is the working directory, which no operator means as the root (an empty variable
        # is unset, as every variable); "/" would make every file of the server a caller's to name.
        ("", [], "must name a directory, got ''"),
        ("/", [], "must be a directory that holds adapters only, got '/', the file system's root"),
    ],
)
def test_a_lora_root_that_is_no_directory_is_refused_naming_the_flag(
    environ,
    root: str,
    flags: list[str],
    said: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    path = tmp_path / root if root not in ("", "/") else root
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--lora-root", str(path), *flags]
    assert decoder_main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"tandem serve decoder: --lora-root (TANDEM_LORA_ROOT) {said.format(root=path)}"
    ]


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            "alpha",
            "adapter 'bad': adapter_config.json:lora_alpha: 100000000000000000...0000000000000000000 "
            "gives a scale",
        ),
        ("targets", "adapter 'bad': adapter_config.json:target_modules: must be a list of module names"),
        ("float8", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: is stored as float8"),
        # peft would give the targeted v_proj of layer 1 random weights (init_lora_weights false)
        (
            "absent",
            "adapter 'bad': adapter_model.safetensors: in {bad} holds no lora_A/lora_B for "
            "model.layers.1.self_attn.v_proj, which",
        ),
    ],
)
def test_a_malformed_adapter_fails_in_one_line_naming_the_field(
    environ,
    tiny_model_dir: Path,
    adapter: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: str,
    said: str,
) -> None:
    # Each was a traceback and exit 1 (OverflowError, TypeError, NotImplementedError from torch).
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    text = json.dumps(config | ({"target_modules": [["q_proj"]]} if edit == "targets" else {}))
    if edit == "alpha":  # 401 digits: json reads it, no float holds it
        text = text.replace(f'"lora_alpha": {config["lora_alpha"]}', '"lora_alpha": 1' + "0" * 400)
    (bad / "adapter_config.json").write_text(text)
    tensors = load_file(adapter / "adapter_model.safetensors")
    if edit == "float8":
        tensors = {k: v.to(torch.float8_e4m3fn) for k, v in tensors.items()}
    if edit == "absent":
        tensors = {k: v for k, v in tensors.items() if ".layers.1.self_attn.v_proj." not in k}
    save_file(tensors, bad / "adapter_model.safetensors")
    assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", "--lora", f"bad={bad}"]) == 2
    assert said.format(bad=bad) in capsys.readouterr().err
