"""`--quantization`: what cannot be served quantized is one line naming the flag and exit 2, before any
weight is read or a port is opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.api.start_checks import check_fits
from tandem.decoder.config import DecoderConfig, EngineConfig

PREFIX = "tandem serve decoder: --quantization (TANDEM_QUANTIZATION)"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--dtype", "float16"], "gguf needs --dtype bfloat16 or float32, got 'float16'"),
        (
            ["--device", "cuda"],
            "gguf needs --device cpu or an XLA device such as neuron (the quantized kernels are CPU "
            "kernels), got 'cuda'",
        ),
        (
            ["--native-kernels", "false"],
            "gguf needs --native-kernels on: the quantized linears are C kernels",
        ),
    ],
)
def test_settings_the_quantized_kernels_cannot_run_are_refused(
    flags: list[str], said: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--quantization", "gguf", *flags]
    assert decoder_main(argv) == 2
    assert capsys.readouterr().err == f"{PREFIX} {said}\n"


def test_an_xla_device_refuses_int8_activations(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The XLA device dequantizes each weight in its graphs, on one device or several
    # (tests/xla/test_quantized.py and test_quantized_devices.py serve it); int8 activations are a CPU kernel.
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--device", "neuron", "--quantization", "int8"]
    assert decoder_main([*argv, "--world-size", "2", "--quantized-activations", "int8"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --quantized-activations (TANDEM_QUANTIZED_ACTIVATIONS) int8 needs --device "
        "cpu (it rounds inputs in a CPU kernel), got 'neuron'\n"
    )


@pytest.mark.parametrize("quantization", ["gguf", "int8", "int4"])
def test_quantized_weights_on_two_xla_devices_are_a_valid_engine_config(
    quantization: str, tmp_path: Path
) -> None:
    # They were refused naming --world-size: the devices now split the codes as the dense weights
    # (tests/xla/test_quantized_devices.py serves them).
    config = EngineConfig(
        model_dir=tmp_path,
        device="neuron",
        num_devices=2,
        static_shapes=True,
        compile=True,
        quantization=quantization,
        quantized_from=tmp_path / "m.gguf" if quantization == "gguf" else None,
    )
    assert (config.num_devices, config.quantization) == (2, quantization)


def test_gguf_needs_a_gguf_file_not_a_checkpoint_directory(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", "--quantization", "gguf"]) == 2
    said = f"gguf needs --model to be a GGUF file, got the directory {tiny_model_dir}"
    assert capsys.readouterr().err == f"{PREFIX} {said}\n"


def test_an_unknown_quantization_names_the_ones_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    assert decoder_main(["--quantization", "int3", "--port", "0"]) == 2
    assert "'int3' is not one of 'none', 'gguf', 'int8', 'int4'" in capsys.readouterr().err


GROUP = "tandem serve decoder: --quantization-group-size (TANDEM_QUANTIZATION_GROUP_SIZE)"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--quantization", "int4", "--quantization-group-size", "48"],
            "must be a positive multiple of 32, got 48",
        ),
        (
            ["--quantization", "int4", "--quantization-group-size", "0"],
            "must be a positive multiple of 32, got 0",
        ),
        (
            ["--quantization", "int8", "--quantization-group-size", "64"],
            "is only used by --quantization int4, not 'int8'",
        ),
        # The tiny checkpoint's rows are 64 inputs (hidden_size) and 192 (intermediate_size) wide.
        (
            ["--quantization", "int4", "--quantization-group-size", "128"],
            "int4 cannot quantize this checkpoint: 64, the input width of qkv_proj and gate_up_proj "
            "(hidden_size), is not a multiple of 128",
        ),
    ],
)
def test_a_group_size_that_does_not_divide_every_row_is_one_line_and_exit_2(
    flags: list[str], said: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", *flags]) == 2
    assert capsys.readouterr().err == f"{GROUP} {said}\n"


def test_int8_and_int4_need_what_the_quantized_kernels_need(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--quantization", "int8", "--dtype", "float16"]
    assert decoder_main(argv) == 2
    assert capsys.readouterr().err == f"{PREFIX} int8 needs --dtype bfloat16 or float32, got 'float16'\n"


ACTIVATIONS = "tandem serve decoder: --quantized-activations (TANDEM_QUANTIZED_ACTIVATIONS)"


def test_int8_activations_without_quantized_weights_is_one_line_and_exit_2(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--quantized-activations", "int8"]
    assert decoder_main(argv) == 2
    said = "int8 needs --quantization gguf, int8 or int4 (it rounds the inputs of quantized linears)"
    assert capsys.readouterr().err == f"{ACTIVATIONS} {said}\n"


def test_an_unknown_activation_kind_names_the_ones_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    assert decoder_main(["--quantized-activations", "int4", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "--quantized-activations" in err
        and "'int4' is not one of 'none', 'int8'" in err
    )


WORLD_SIZE = "tandem serve decoder: --world-size (TANDEM_WORLD_SIZE)"


def test_ranks_whose_share_of_a_row_parallel_projection_is_not_whole_blocks_are_one_line_and_exit_2(
    checkpoints, capsys: pytest.CaptureFixture[str]
) -> None:
    """Quantized weights are cut on whole blocks of 32 inputs: llama2-bias's o_proj takes 64 (4 heads of
    16), 16 a rank over 4 ranks. Dense, the same model shards over 4 (a cut falls anywhere)."""
    model_dir = str(checkpoints["llama2-bias"].path)
    argv = ["--model", model_dir, "--port", "0", "--world-size", "4", "--quantization", "int8"]
    assert decoder_main(argv) == 2
    said = (
        ": int8 weights cannot be sharded: o_proj (num_heads * head_dim) takes 64 inputs, 16 per rank over "
        "4 ranks: quantized weights are cut on whole blocks of 32 inputs, so each rank's share must be a "
        "multiple of 32"
    )
    assert capsys.readouterr().err == f"{WORLD_SIZE}{said}\n"
    check_fits(model_dir, "float32", "none", 32, 4)
    check_fits(model_dir, "float32", "int8", 32, 2)  # 32 inputs a rank: one block
    engine = EngineConfig(model_dir=Path(model_dir), dtype="float32", quantization="int8")
    assert DecoderConfig(engine, world_size=2).world_size == 2  # quantized weights shard
