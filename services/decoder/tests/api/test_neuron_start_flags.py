"""--device neuron's start-up flags are refused before the server listens, one line naming the flag:
the world size (its devices, on XLA's CPU device virtual ones of the host), the KV pool those devices
hold in the host's memory, and the buckets, too small or past every step. Each of these started the
server and then failed 13-35 s later naming no flag, or took the host's memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.common.memory_limit import MemoryLimit
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.api.start_checks import check_model
from tandem.decoder.models import kv_pool

WORLD_SIZE = "tandem serve decoder: --world-size (TANDEM_WORLD_SIZE)"
# The tiny model (4 query, 2 KV heads) at 64 positions: one block of 16 positions and the reserved one.
NEURON = ["--device", "neuron", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
NEURON += ["--max-model-len", "64", "--block-size", "16"]


@pytest.fixture
def host_cpu(monkeypatch: pytest.MonkeyPatch, environ) -> None:
    """XLA's CPU device, as where the Neuron SDK is not installed, its device count ours to set."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)


def _check(model_dir: Path, *flags: str) -> None:
    config = config_from_args(["--model", str(model_dir), *NEURON, *flags])
    check_model(config, world_size=1)  # the decoder's one process: the devices are SPMD's


@pytest.mark.parametrize(
    ("world_size", "said"), [("0", "must be >= 1, got 0"), ("-1", "must be >= 1, got -1")]
)
def test_a_world_size_below_one_names_the_flag_not_the_engines_field(
    world_size: str, said: str, capsys: pytest.CaptureFixture[str], environ
) -> None:
    assert decoder_main(["--device", "neuron", "--world-size", world_size, "--port", "0"]) == 2
    assert capsys.readouterr().err == f"{WORLD_SIZE} {said}\n"


def test_a_world_size_past_the_most_neuroncores_an_instance_has_is_refused(
    capsys: pytest.CaptureFixture[str], environ
) -> None:
    """--world-size 100000 asked XLA's CPU device for as many virtual devices, and the host ran out."""
    assert decoder_main(["--device", "neuron", "--world-size", "100000", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"{WORLD_SIZE} must be at most 128 (the most NeuronCores ")
    assert config_from_args(["--device", "neuron", "--world-size", "128"]).world_size == 128


def test_a_world_size_the_users_cpu_num_devices_does_not_give_is_refused_before_listening(
    tiny_model_dir: Path, host_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    with pytest.raises(ConfigError) as refused:
        _check(tiny_model_dir, "--world-size", "4")
    assert refused.value.field == "world_size"
    assert refused.value.reason == (
        "is 4, but CPU_NUM_DEVICES=2 gives XLA's CPU device that many virtual devices: set it to the world "
        "size, or unset it"
    )
    _check(tiny_model_dir, "--world-size", "2")


def test_a_pool_whose_copies_on_the_virtual_devices_pass_the_hosts_memory_is_refused_naming_the_flag(
    tiny_model_dir: Path, host_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 KV heads do not divide over 4 devices: each holds the 1 GiB pool whole (5.19 GB peak RSS)."""
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(3 * 2**30, None))
    gib = ["--kv-cache-bytes", str(2**30)]
    _check(tiny_model_dir, *gib)  # one device: the pool once
    _check(tiny_model_dir, *gib, "--world-size", "2")  # split over 2: the pool once in all
    with pytest.raises(ConfigError) as refused:
        _check(tiny_model_dir, *gib, "--world-size", "4")
    assert refused.value.field == "kv_cache_bytes"
    assert "more than the 3,221,225,472 bytes of memory of this host: XLA's CPU device holds the pool " in (
        refused.value.reason
    )
    assert "whole on each of its 4 virtual devices (the model's 4 query and 2 KV heads do not divide" in (
        refused.value.reason
    )


def test_a_pool_on_neuroncores_is_left_to_the_runtime(
    tiny_model_dir: Path, environ, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(2**20, None))
    _check(tiny_model_dir, "--kv-cache-bytes", str(2**30), "--world-size", "4")


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--seq-buckets", "4,1000000"], "seq_buckets"),
        (["--token-buckets", "32,100000000"], "token_buckets"),
        (["--block-table-buckets", "4,100000000"], "block_table_buckets"),
        (["--seq-buckets", "2"], "seq_buckets"),
        (["--token-buckets", "8"], "token_buckets"),
        (["--token-buckets", "1,32"], "token_buckets"),
        (["--block-table-buckets", "2"], "block_table_buckets"),
    ],
)
def test_buckets_too_small_or_past_every_step_are_refused_before_listening(
    tiny_model_dir: Path, host_cpu: None, flags: list[str], field: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _check(tiny_model_dir, *flags)
    assert refused.value.field == field


def test_cpu_static_shapes_buckets_too_small_are_one_line_naming_the_flag_before_listening(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], environ
) -> None:
    """They failed at load, exit 1, after "listening on"."""
    flags = ["--model", str(tiny_model_dir), "--static-shapes", "true", "--port", "0"]
    assert decoder_main([*flags, "--block-table-buckets", "1"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(
        "tandem serve decoder: --block-table-buckets (TANDEM_BLOCK_TABLE_BUCKETS): the largest must hold the "
        "blocks of a "
    ), said
    assert decoder_main([*flags, "--token-buckets", "1,2"]) == 2
    assert capsys.readouterr().err.startswith(
        "tandem serve decoder: --token-buckets (TANDEM_TOKEN_BUCKETS): "
    )


def test_cpu_static_shapes_refuse_seq_buckets_without_the_padding_sequence_before_listening(
    tiny_model_dir: Path, environ
) -> None:
    """--seq-buckets 1 beside --max-num-seqs 4 was accepted; the engine then failed every request."""
    flags = ["--model", str(tiny_model_dir), "--static-shapes", "true", "--max-num-seqs", "4"]
    with pytest.raises(ConfigError) as refused:
        check_model(config_from_args([*flags, "--seq-buckets", "1"]), world_size=1)
    assert refused.value.field == "seq_buckets"
    check_model(config_from_args([*flags, "--seq-buckets", "1,5"]), world_size=1)


def test_block_table_buckets_are_bounded_by_the_context_configured_not_the_pools_cap(
    tiny_model_dir: Path, environ
) -> None:
    """A 4-block pool holds 48 positions of --max-model-len 80: --block-table-buckets 5 ran before the
    bound, and was then refused naming "max_model_len 48"."""
    flags = ["--model", str(tiny_model_dir), "--static-shapes", "true", "--max-model-len", "80"]
    flags += ["--num-kv-blocks", "4", "--block-size", "16"]
    check_model(config_from_args([*flags, "--block-table-buckets", "5"]), world_size=1)


def test_a_budget_too_small_for_the_default_prefill_buckets_names_its_own_flag(
    tiny_model_dir: Path, host_cpu: None
) -> None:
    """It named --token-buckets, which the user never gave."""
    with pytest.raises(ConfigError) as refused:
        _check(tiny_model_dir, "--max-num-seqs", "1", "--max-num-batched-tokens", "1")
    assert refused.value.field == "max_num_batched_tokens"


@pytest.mark.parametrize("timeout", ["nan", "inf", "1e300", "0"])
def test_a_collective_timeout_not_finite_or_past_a_day_is_one_line_naming_the_flag(
    timeout: str, capsys: pytest.CaptureFixture[str], environ
) -> None:
    """NaN with --world-size 2 was a ValueError traceback once the ranks started."""
    argv = ["--world-size", "2", "--collective-timeout-s", timeout, "--port", "0"]
    assert decoder_main(argv) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --collective-timeout-s (TANDEM_COLLECTIVE_TIMEOUT_S) must be > 0 and at most "
        f"86,400 (a day), got {float(timeout)}\n"
    )
