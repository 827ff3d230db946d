"""`tandem up`: what either service would refuse is said before both start, naming `up`'s own flag
where it has one, else the service's flag and variable."""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from pathlib import Path

import click
import pytest
import torch

from common.tests.ports import free_port
from tandem import up, up_commands
from tandem.client.errors import ConfigError
from tandem.up_config import UpConfig


def _config(model_dir: Path, host: str = "127.0.0.1", **fields: object) -> UpConfig:
    return UpConfig(model_dir, host, 50781, 50782, None, None, **fields)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device runs --device cuda")
def test_a_device_this_torch_cannot_run_is_up_s_device_flag(tiny_model_dir: Path) -> None:
    """Both services started, then the decoder exited 2 and `up` 1."""
    with pytest.raises(ConfigError, match="sees no CUDA device") as caught:
        up.check_device(_config(tiny_model_dir, device="cuda"))
    assert caught.value.field == "device"


def test_gguf_of_a_checkpoint_directory_is_up_s_quantization_flag(tiny_model_dir: Path) -> None:
    with pytest.raises(
        ConfigError, match="gguf needs --model to be a GGUF file, got the directory"
    ) as caught:
        up.check_decoder_fits(_config(tiny_model_dir, quantization="gguf"), tiny_model_dir)
    assert caught.value.field == "quantization"


def test_an_encoder_variable_it_refuses_is_named_before_anything_starts(
    tiny_model_dir: Path, environ: Callable[[dict[str, str]], None]
) -> None:
    """Both services started, then the encoder exited 2 and `up` 1."""
    environ({"TANDEM_ENCODER_MAX_BATCH_SIZE": "0"})
    with pytest.raises(ConfigError) as caught:
        up.check_encoder_config(_config(tiny_model_dir), tiny_model_dir)
    line = up._service_flag_error(up.command(), caught.value, "encoder").message
    assert line == "the encoder's --max-batch-size (TANDEM_ENCODER_MAX_BATCH_SIZE) must be >= 1, got 0"


def test_an_encoder_adapter_that_is_not_there_is_said_by_up_before_anything_starts(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """`up` ran only the encoder's flag parsing, not its start-up checks: both services started, then
    the encoder exited 2 and `up` 1."""
    started: list[object] = []
    monkeypatch.setattr(up, "run_services", started.append)
    environ({"TANDEM_ENCODER_EMBEDDER": "soft-prompt", "TANDEM_ENCODER_ADAPTER": str(tmp_path / "none")})
    ports = [str(free_port()) for _ in range(2)]
    argv = ["--model", str(tiny_model_dir), "--encoder-port", ports[0], "--decoder-port", ports[1]]
    assert up.main(argv) == 2
    assert capsys.readouterr().err == (
        f"tandem up: the encoder's --adapter (TANDEM_ENCODER_ADAPTER): {tmp_path / 'none'} does not exist\n"
    )
    assert started == []


def test_an_encoder_message_bound_without_room_for_an_image_is_refused_before_anything_starts(
    environ: Callable[[dict[str, str]], None], tmp_path: Path
) -> None:
    """The checkpoint takes images (config.json says so): the encoder refused 2,000 bytes once started."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlavaForConditionalGeneration"]}')
    environ({"TANDEM_ENCODER_MAX_MESSAGE_BYTES": "2000"})
    with pytest.raises(ConfigError, match="2000 leaves no room for an image") as caught:
        up.check_encoder_config(_config(tmp_path), tmp_path)
    assert caught.value.field == "max_message_bytes"


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0])
def test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused(
    tiny_model_dir: Path, grace: float
) -> None:
    """NaN passed `< 0`: the services refused it once started, and `up` killed them at once."""
    with pytest.raises(ConfigError, match="grace_s must be a finite number of seconds"):
        _config(tiny_model_dir, grace_s=grace)


def test_the_services_are_reached_at_an_ipv6_host_in_brackets(tiny_model_dir: Path) -> None:
    """ "::1:50781" was no address the decoder's --encoder or `tandem wait` could use."""
    config = _config(tiny_model_dir, host="::1")
    assert up_commands.ready_targets(config)["the encoder"] == "[::1]:50781"
    assert "[::1]:50781" in up_commands.serve_command("decoder", config)
    assert up_commands.ready_targets(_config(tiny_model_dir, host="::"))["the decoder"] == "127.0.0.1:50782"


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        (
            {"TANDEM_ENCODER_MAX_BATCH_SIZE": "abc"},
            "the encoder's --max-batch-size (TANDEM_ENCODER_MAX_BATCH_SIZE): 'abc' is not a valid integer.",
        ),
        (
            {"TANDEM_MAX_MODEL_LEN": "abc"},
            "the decoder's --max-model-len (TANDEM_MAX_MODEL_LEN): 'abc' is not a valid integer.",
        ),
    ],
)
def test_a_service_variable_that_does_not_parse_is_said_by_up_before_anything_starts(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    said: str,
) -> None:
    """The line began `tandem serve encoder:`, a command nobody typed."""
    started: list[object] = []
    monkeypatch.setattr(up, "run_services", started.append)
    environ(variables)
    ports = [str(free_port()) for _ in range(2)]
    argv = ["--model", str(tiny_model_dir), "--encoder-port", ports[0], "--decoder-port", ports[1]]
    assert up.main(argv) == 2
    assert capsys.readouterr().err == f"tandem up: {said}\n"
    assert started == []


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("abc", "--max-choices (TANDEM_OPENAI_MAX_CHOICES): 'abc' is not a valid integer."),
        ("0", "--max-choices (TANDEM_OPENAI_MAX_CHOICES) must be >= 1, got 0"),
    ],
)
def test_a_gateway_variable_it_refuses_is_said_by_up_before_anything_starts(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    said: str,
) -> None:
    """All three services started, then the gateway said `tandem serve openai: ...` and `up` exited 1."""
    started: list[object] = []
    monkeypatch.setattr(up, "run_services", started.append)
    environ({"TANDEM_OPENAI_MAX_CHOICES": value})
    ports = [str(free_port()) for _ in range(3)]
    argv = ["--model", str(tiny_model_dir), "--encoder-port", ports[0], "--decoder-port", ports[1]]
    assert up.main([*argv, "--openai-port", ports[2]]) == 2
    assert capsys.readouterr().err == f"tandem up: the OpenAI gateway's {said}\n"
    assert started == []


def test_a_gateway_max_connections_over_the_open_files_limit_is_said_by_up_before_anything_starts(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway inherits `up`'s limit and refused it only once all three had started; `up` exited 1."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    started: list[object] = []
    monkeypatch.setattr(up, "run_services", started.append)
    environ({"TANDEM_OPENAI_MAX_CONNECTIONS": str(hard)})  # two descriptors a connection: twice the limit
    ports = [str(free_port()) for _ in range(3)]
    argv = ["--model", str(tiny_model_dir), "--encoder-port", ports[0], "--decoder-port", ports[1]]
    assert up.main([*argv, "--openai-port", ports[2]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"tandem up: the OpenAI gateway's --max-connections (TANDEM_OPENAI_MAX_CONNECTIONS) of {hard} "
        "needs about "
    )
    assert err.endswith(
        f"open files, over this process's limit of {hard} (ulimit -Hn): lower it or raise the limit\n"
    )
    assert started == []


def test_the_gateway_s_variables_are_not_read_without_its_port(
    tiny_model_dir: Path, environ: Callable[[dict[str, str]], None]
) -> None:
    environ({"TANDEM_OPENAI_MAX_CHOICES": "abc"})
    up.check_gateway_config(_config(tiny_model_dir))


def test_a_service_value_from_up_s_own_flag_that_does_not_parse_names_up_s_flag() -> None:
    """`up` passes its --grace-s on; were the service to refuse it, the flag typed is up's."""
    # The encoder's own option as its command declares it (common's tests import no service: the
    # packaging test holds each unit to its own and those below it); only its name is matched.
    grace = click.Option(["--grace-s"], envvar="TANDEM_ENCODER_GRACE_S")
    error = click.BadParameter("'x' is not a number of seconds", param=grace)
    line = up._service_usage_error(up.command(), error, "encoder").message
    assert line == "--grace-s (TANDEM_UP_GRACE_S): 'x' is not a number of seconds"
