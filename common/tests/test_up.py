"""`tandem up`: what either service would refuse is said before both start, naming `up`'s own flag
where it has one, else the service's flag and variable."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem import up
from tandem.client.errors import ConfigError
from tandem.up import UpConfig


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
        up.check_encoder_config(_config(tiny_model_dir))
    line = up._service_flag_error(up.command(), caught.value, "encoder").message
    assert line == "the encoder's --max-batch-size (TANDEM_ENCODER_MAX_BATCH_SIZE) must be >= 1, got 0"


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
    assert up.ready_targets(config)["the encoder"] == "[::1]:50781"
    assert "[::1]:50781" in up.serve_command("decoder", config)
    assert up.ready_targets(_config(tiny_model_dir, host="::"))["the decoder"] == "127.0.0.1:50782"
