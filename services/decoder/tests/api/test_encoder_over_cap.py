"""Each of the four messages over a cap (this decoder's CLIENT side, the encoder's SERVER side; the
request carrying the input, the reply carrying the rows; read by tandem.client.over_cap, specified in
common's test_over_cap.py) is described naming that side's --max-message-bytes. (That `encoder_parts`
makes these INVALID_ARGUMENT on the caller's field, through a real gRPC channel and server, is specified
in test_encoder_errors.py.)"""

from __future__ import annotations

import pytest

from tandem.client.over_cap import OverCap
from tandem.decoder.api.encoder_over_cap import description, rows_too_large


def test_a_reply_over_this_decoders_cap_is_the_rows_too_large_for_its_max_message_bytes() -> None:
    assert description(OverCap(True, True, 131087, 65536), 65536) == rows_too_large(
        65536, "a reply of 131087 bytes"
    )
    assert rows_too_large(65536, "a reply of 131087 bytes") == (
        "the encoder's rows are larger than this decoder's --max-message-bytes 65536 allows (a reply of "
        "131087 bytes): send a shorter input, or start the decoder with a larger --max-message-bytes"
    )


def test_a_request_over_this_decoders_cap_says_the_call_adds_its_own_fields_to_the_input() -> None:
    assert description(OverCap(True, False, 65601, 65536), 65536) == (
        "its Embed request of 65601 bytes (the input and the call's own fields) is larger than this "
        "decoder's --max-message-bytes 65536 allows: send a smaller input, or start the decoder with a "
        "larger --max-message-bytes"
    )


@pytest.mark.parametrize(
    ("over", "what"),
    [
        (
            OverCap(False, False, 40061, 32768),
            "its Embed request of 40061 bytes is larger than the encoder's --max-message-bytes 32768 allows",
        ),
        (
            OverCap(False, True, 38415, 32768),
            "its rows are larger than the encoder's own --max-message-bytes 32768 allows (a reply of 38415 "
            "bytes)",
        ),
    ],
    ids=["request", "reply"],
)
def test_a_message_over_the_encoders_cap_names_the_encoders_own_max_message_bytes(
    over: OverCap, what: str
) -> None:
    assert description(over, 65536) == (
        what + ": send a smaller input, or start the encoder with a larger --max-message-bytes"
    )
