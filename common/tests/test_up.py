"""`tandem up`: what either service would refuse is said before both start, naming `up`'s own flag
where it has one, else the service's flag and variable."""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

import click
import pytest
import torch

from common.tests.ports import free_port
from common.tests.up_configs import up_config
from tandem import up
from tandem.client.errors import ConfigError


def _said_by_up(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gateway: bool = False,
) -> str:
    """`tandem up --model MODEL_DIR` on free ports (and an --openai-port with `gateway`) refused before any
    service started, exit 2: what it said on stderr."""
    started: list[object] = []
    monkeypatch.setattr(up, "run_services", started.append)
    ports = [str(free_port()) for _ in range(3)]
    argv = ["--model", str(model_dir), "--encoder-port", ports[0], "--decoder-port", ports[1]]
    assert up.main([*argv, "--openai-port", ports[2]] if gateway else argv) == 2
    assert started == []
    return capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device runs --device cuda")
def test_a_device_this_torch_cannot_run_is_up_s_device_flag(tiny_model_dir: Path) -> None:
    """Both services started, then the decoder exited 2 and `up` 1."""
    with pytest.raises(ConfigError, match="sees no CUDA device") as caught:
        up.check_device(up_config(tiny_model_dir, device="cuda"))
    assert caught.value.field == "device"


def test_gguf_of_a_checkpoint_directory_is_up_s_quantization_flag(tiny_model_dir: Path) -> None:
    with pytest.raises(
        ConfigError, match="gguf needs --model to be a GGUF file, got the directory"
    ) as caught:
        up.check_decoder_fits(up_config(tiny_model_dir, quantization="gguf"), tiny_model_dir)
    assert caught.value.field == "quantization"


def test_an_encoder_variable_it_refuses_is_named_before_anything_starts(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both services started, then the encoder exited 2 and `up` 1."""
    environ({"TANDEM_ENCODER_MAX_BATCH_SIZE": "0"})
    assert _said_by_up(tiny_model_dir, monkeypatch, capsys) == (
        "tandem up: the encoder's --max-batch-size (TANDEM_ENCODER_MAX_BATCH_SIZE) must be >= 1, got 0\n"
    )


def test_an_encoder_adapter_that_is_not_there_is_said_by_up_before_anything_starts(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """`up` ran only the encoder's flag parsing, not its start-up checks: both services started, then
    the encoder exited 2 and `up` 1."""
    environ({"TANDEM_ENCODER_EMBEDDER": "soft-prompt", "TANDEM_ENCODER_ADAPTER": str(tmp_path / "none")})
    assert _said_by_up(tiny_model_dir, monkeypatch, capsys) == (
        f"tandem up: the encoder's --adapter (TANDEM_ENCODER_ADAPTER): {tmp_path / 'none'} does not exist\n"
    )


def test_an_encoder_message_bound_without_room_for_an_image_is_refused_before_anything_starts(
    environ: Callable[[dict[str, str]], None], tmp_path: Path
) -> None:
    """The checkpoint takes images (config.json says so): the encoder refused 2,000 bytes once started."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlavaForConditionalGeneration"]}')
    environ({"TANDEM_ENCODER_MAX_MESSAGE_BYTES": "2000"})
    with pytest.raises(ConfigError, match="2000 leaves no room for an image") as caught:
        up.check_encoder_config(up_config(tmp_path), tmp_path)
    assert caught.value.field == "max_message_bytes"


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
    environ(variables)
    assert _said_by_up(tiny_model_dir, monkeypatch, capsys) == f"tandem up: {said}\n"


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
    environ({"TANDEM_OPENAI_MAX_CHOICES": value})
    err = _said_by_up(tiny_model_dir, monkeypatch, capsys, gateway=True)
    assert err == f"tandem up: the OpenAI gateway's {said}\n"


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
    environ({"TANDEM_OPENAI_MAX_CONNECTIONS": str(hard)})  # two descriptors a connection: twice the limit
    err = _said_by_up(tiny_model_dir, monkeypatch, capsys, gateway=True)
    assert err.startswith(
        f"tandem up: the OpenAI gateway's --max-connections (TANDEM_OPENAI_MAX_CONNECTIONS) of {hard} "
        "needs about "
    )
    assert err.endswith(
        f"open files, over this process's limit of {hard} (ulimit -Hn): lower it or raise the limit\n"
    )


def test_the_gateway_s_variables_are_not_read_without_its_port(
    tiny_model_dir: Path, environ: Callable[[dict[str, str]], None]
) -> None:
    environ({"TANDEM_OPENAI_MAX_CHOICES": "abc"})
    up.check_gateway_config(up_config(tiny_model_dir))


def test_a_service_value_from_up_s_own_flag_that_does_not_parse_names_up_s_flag(
    tiny_model_dir: Path,
    environ: Callable[[dict[str, str]], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`up` passes its --grace-s on; were the service to refuse it, the flag typed is up's."""
    # The encoder's own option as its command declares it (common's tests import no service: the
    # packaging test holds each unit to its own and those below it); only its name is matched. Its
    # parse refusing a value `up`'s own parse took is the encoder's check failing so.
    grace = click.Option(["--grace-s"], envvar="TANDEM_ENCODER_GRACE_S")

    def refuse(config: object, model_dir: Path) -> None:
        raise click.BadParameter("'x' is not a number of seconds", param=grace)

    environ({})
    monkeypatch.setattr(up, "check_encoder_config", refuse)
    assert _said_by_up(tiny_model_dir, monkeypatch, capsys) == (
        "tandem up: --grace-s (TANDEM_UP_GRACE_S): 'x' is not a number of seconds\n"
    )
