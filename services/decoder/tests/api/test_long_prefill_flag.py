"""`--long-prefill-token-threshold`: while a decoding request shares a step, the most positions a prefill
chunk and the decode rows beside it span (the flag or its variable; 0 = off), carried in its EngineConfig;
a negative is one line naming the flag and exit 2, before any weight is read or a port is opened."""

from __future__ import annotations

import pytest

from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main

PREFIX = "tandem serve decoder: --long-prefill-token-threshold (TANDEM_LONG_PREFILL_TOKEN_THRESHOLD)"


def test_the_threshold_defaults_to_512_and_is_set_by_the_flag_or_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def threshold(*argv: str) -> int:
        return config_from_args(argv).engine.long_prefill_token_threshold

    assert threshold() == 512
    assert threshold("--long-prefill-token-threshold", "0") == 0
    monkeypatch.setenv("TANDEM_LONG_PREFILL_TOKEN_THRESHOLD", "256")
    assert threshold() == 256


def test_a_negative_threshold_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert decoder_main(["--long-prefill-token-threshold", "-1", "--port", "0"]) == 2
    assert capsys.readouterr().err == f"{PREFIX} must be >= 0 (0: off), got -1\n"
