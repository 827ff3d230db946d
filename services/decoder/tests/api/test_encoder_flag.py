"""`--encoder`: repeated or comma-separated addresses make one balanced address; one that cannot be
used is one line naming the flag and exit 2, before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main


def test_repeated_and_comma_separated_encoders_are_one_balanced_address(tiny_model_dir: Path) -> None:
    model = ["--model", str(tiny_model_dir)]
    assert config_from_args(model).encoder_address == ""  # none: encoder parts are refused
    config = config_from_args(
        [*model, "--encoder", "10.0.0.1:50051", "--encoder", "10.0.0.2:50051, 10.0.0.3:1"]
    )
    assert config.encoder_address == "10.0.0.1:50051,10.0.0.2:50051,10.0.0.3:1"
    assert config_from_args([*model, "--encoder-cache-bytes", "0"]).encoder_cache_bytes == 0


def test_an_encoder_address_that_cannot_be_used_is_one_line_naming_the_flag(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--encoder", "10.0.0.1:1,[::1]:2"]
    assert decoder_main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tandem serve decoder: --encoder (TANDEM_ENCODER): address")
    assert "mixes IPv4 and IPv6" in line


@pytest.mark.parametrize(
    "argv", [["--encoder", ""], ["--encoder", "  "], ["--encoder", "10.0.0.1:1", "--encoder", ""]]
)
def test_an_encoder_given_empty_is_refused_rather_than_read_as_none(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """As an empty list flag is (`--seq-buckets ""`): a script's variable left empty served with no
    encoder, refusing every encoder part, while its operator thought it had one."""
    assert decoder_main([*argv, "--port", "0"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tandem serve decoder: --encoder (TANDEM_ENCODER): '")
    assert line.endswith(
        "' is an empty list: give at least one address (host:port, or dns:///name:port), or leave the "
        "flag out for none"
    )


def test_an_empty_variable_is_unset_and_means_no_encoder(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_ENCODER", "")
    assert config_from_args(["--model", str(tiny_model_dir)]).encoder_address == ""
