"""The limits both services apply alike: the request id, and how much one Tokenize call may ask."""

from __future__ import annotations

import pytest

from tandem.client.errors import InvalidArgument
from tandem.common.wire_limits import (
    MAX_REQUEST_ID_BYTES,
    MAX_TOKENIZE_TEXTS,
    check_request_id,
    check_tokenize_texts,
)


def test_a_request_id_is_bounded_in_utf8_bytes_not_characters() -> None:
    check_request_id("x" * MAX_REQUEST_ID_BYTES)
    with pytest.raises(InvalidArgument) as info:
        check_request_id("é" * (MAX_REQUEST_ID_BYTES // 2 + 1))  # 2 bytes each
    assert info.value.field == "request_id"
    assert f"at most {MAX_REQUEST_ID_BYTES} bytes" in info.value.description


@pytest.mark.parametrize("request_id", ["r1\nINFO forged line", "r1\u2029", " r1"])
def test_a_request_id_is_a_label_of_either_service_with_no_line_break_or_outer_space(request_id: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_request_id(request_id)
    assert info.value.field == "request_id"


def test_a_tokenize_call_may_hold_one_context_of_text_and_no_more() -> None:
    check_tokenize_texts(["a" * 40, "b" * 40], max_chars_per_token=10, max_positions=8, limit="max_model_len")
    with pytest.raises(InvalidArgument) as info:
        check_tokenize_texts(
            ["a" * 40, "b" * 41], max_chars_per_token=10, max_positions=8, limit="max_model_len"
        )
    assert info.value.field == "texts"
    assert "exceed max_model_len 8" in info.value.description
    assert "at most 80 characters" in info.value.description


def test_a_tokenize_call_holds_a_bounded_number_of_texts_counted_before_their_lengths() -> None:
    check_tokenize_texts(
        [""] * MAX_TOKENIZE_TEXTS, max_chars_per_token=1, max_positions=0, limit="max_model_len"
    )
    with pytest.raises(InvalidArgument) as info:
        check_tokenize_texts(["a"] * (MAX_TOKENIZE_TEXTS + 1), 1, 0, "max_model_len")  # both broken
    assert info.value.field == "texts" and f"limit of {MAX_TOKENIZE_TEXTS} per call" in info.value.description
