"""--model-name: the name GetModelInfo reports and requests are checked against is one a request can
carry (model_name.MAX_MODEL_NAME_BYTES), as the encoder's is; a longer one is the flag's one line."""

from __future__ import annotations

import pytest

from tandem.decoder.api.main import main as decoder_main


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
