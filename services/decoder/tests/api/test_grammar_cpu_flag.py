"""`--max-grammar-cpu-ms-per-token`: the structured-output limit on a grammar's CPU time per token is
the decoder's to set (flag or variable), carried in its EngineConfig; 0, a negative, NaN or inf is one line
naming the flag and exit 2, before any weight is read or a port is opened."""

from __future__ import annotations

import pytest

from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main

PREFIX = "tandem serve decoder: --max-grammar-cpu-ms-per-token (TANDEM_MAX_GRAMMAR_CPU_MS_PER_TOKEN)"


def test_the_limit_defaults_to_50_ms_and_is_set_by_the_flag_or_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def limit(*argv: str) -> float:
        return config_from_args(argv).engine.max_grammar_cpu_ms_per_token

    assert limit() == 50
    assert limit("--max-grammar-cpu-ms-per-token", "7.5") == 7.5
    monkeypatch.setenv("TANDEM_MAX_GRAMMAR_CPU_MS_PER_TOKEN", "200")
    assert limit() == 200


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_limit_that_would_fail_every_grammar_or_none_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--max-grammar-cpu-ms-per-token", value, "--port", "0"]) == 2
    assert capsys.readouterr().err == f"{PREFIX} must be > 0 and finite, got {float(value)}\n"


def test_the_step_budget_defaults_to_250_ms_and_is_set_by_the_flag_or_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def limit(*argv: str) -> float:
        return config_from_args(argv).engine.max_grammar_cpu_ms_per_step

    assert limit() == 250
    assert limit("--max-grammar-cpu-ms-per-step", "40") == 40
    monkeypatch.setenv("TANDEM_MAX_GRAMMAR_CPU_MS_PER_STEP", "1000")
    assert limit() == 1000


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_step_budget_that_would_fail_every_grammar_or_none_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--max-grammar-cpu-ms-per-step", value, "--port", "0"]) == 2
    prefix = "tandem serve decoder: --max-grammar-cpu-ms-per-step (TANDEM_MAX_GRAMMAR_CPU_MS_PER_STEP)"
    assert capsys.readouterr().err == f"{prefix} must be > 0 and finite, got {float(value)}\n"
