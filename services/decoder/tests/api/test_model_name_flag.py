"""--model-name: the name GetModelInfo reports and requests are checked against is one a request can
carry (model_name.MAX_MODEL_NAME_BYTES), as the encoder's is; a longer one is the flag's one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import DecoderConfig, EngineConfig


def test_a_model_name_no_request_could_name_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert decoder_main(["--model-name", "n" * 257, "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --model-name (TANDEM_MODEL_NAME) must be at most 256 bytes of UTF-8 (the "
        "longest `model` a request may name), got 257\n"
    )


def test_a_model_name_of_bytes_no_utf_8_reads_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert decoder_main(["--model-name", "n\udcff", "--port", "0"]) == 2  # a byte 0xff, surrogate-escaped
    assert capsys.readouterr().err == (
        "tandem serve decoder: --model-name (TANDEM_MODEL_NAME): is not UTF-8 text\n"
    )


def test_an_empty_model_name_is_refused_rather_than_read_as_the_directorys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert decoder_main(["--model-name", "", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --model-name (TANDEM_MODEL_NAME) must name a model, got '' (leave the flag "
        "out for the directory's or file's name)\n"
    )


@pytest.mark.parametrize(
    ("name", "why"),
    [
        (
            "tiny\nfake log line",
            "must not hold control characters or line separators, got 'tiny\\nfake log line'",
        ),
        ("tiny\x1b[2J", "must not hold control characters or line separators, got 'tiny\\x1b[2J'"),
        ("tiny ", "must not begin or end with white space, got 'tiny '"),
        ("ti\u200bny", "must not hold invisible characters (U+200B: "),
    ],
)
def test_a_model_name_a_log_line_or_a_listing_would_misshow_is_one_line_naming_the_flag(
    name: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rule an adapter's name follows (model_name.check_label): it is logged, traced and listed too."""
    assert decoder_main(["--model-name", name, "--port", "0"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"tandem serve decoder: --model-name (TANDEM_MODEL_NAME) {why}")
    assert said.count("\n") == 1


@pytest.mark.parametrize(("model", "name"), [("My Model ", "'My Model '"), (".", "''"), ("x/..", "'..'")])
def test_a_directorys_name_that_cannot_be_served_is_one_line_naming_model_not_model_name(
    model: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The name is the path's, and the way out is the flag the operator did not give: it named
    --model-name for 'My Model ', and `--model .` served under ''."""
    (tmp_path / "My Model ").mkdir()
    monkeypatch.chdir(tmp_path)
    assert decoder_main(["--model", model, "--port", "0"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(
        f"tandem serve decoder: --model (TANDEM_MODEL): the directory's name {name} cannot"
    )
    assert said.endswith("): give --model-name\n") and said.count("\n") == 1


def test_a_name_of_words_and_punctuation_is_served(tmp_path) -> None:
    name = "org/Model v2:int4 (ça)"
    assert DecoderConfig(EngineConfig(model_dir=tmp_path), model_name=name).model_name == name
