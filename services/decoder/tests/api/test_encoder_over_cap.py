"""gRPC's status text for a message over a cap is read as whose cap (this decoder's CLIENT side, the
encoder's SERVER side) and which message (the request carrying the input, the reply carrying the rows),
and each of the four is described naming that side's --max-message-bytes. Any other failure is no
message over a cap. (That `encoder_parts` makes these INVALID_ARGUMENT on the caller's field, through a
real gRPC channel and server, is specified in test_encoder_parts.py.)"""

from __future__ import annotations

import grpc
import pytest

from tandem.decoder.api.encoder_over_cap import OverCap, over_cap, rows_too_large


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        ("CLIENT: Received message larger than max (131087 vs. 65536)", OverCap(True, True, 131087, 65536)),
        ("CLIENT: Sent message larger than max (65601 vs. 65536)", OverCap(True, False, 65601, 65536)),
        (
            "Stream removed (SERVER: Received message larger than max (40061 vs. 32768))",
            OverCap(False, False, 40061, 32768),
        ),
        ("SERVER: Sent message larger than max (38415 vs. 32768)", OverCap(False, True, 38415, 32768)),
    ],
    ids=["our-reply", "our-request", "their-request", "their-reply"],
)
def test_the_side_and_the_way_name_whose_cap_refused_which_message(details: str, expected: OverCap) -> None:
    assert over_cap(_error(grpc.StatusCode.RESOURCE_EXHAUSTED, details)) == expected


@pytest.mark.parametrize(
    "error",
    [
        _error(grpc.StatusCode.RESOURCE_EXHAUSTED, "encoder is full"),
        _error(grpc.StatusCode.UNAVAILABLE, "CLIENT: Received message larger than max (131087 vs. 65536)"),
        ValueError("CLIENT: Received message larger than max (131087 vs. 65536)"),
    ],
    ids=["another-exhaustion", "another-code", "not-a-grpc-error"],
)
def test_any_other_failure_is_no_message_over_a_cap(error: BaseException) -> None:
    assert over_cap(error) is None


def test_a_reply_over_this_decoders_cap_is_the_rows_too_large_for_its_max_message_bytes() -> None:
    assert OverCap(True, True, 131087, 65536).description(65536) == rows_too_large(
        65536, "a reply of 131087 bytes"
    )
    assert rows_too_large(65536, "a reply of 131087 bytes") == (
        "the encoder's rows are larger than this decoder's --max-message-bytes 65536 allows (a reply of "
        "131087 bytes): send a shorter input, or start the decoder with a larger --max-message-bytes"
    )


def test_a_request_over_this_decoders_cap_says_the_call_adds_its_own_fields_to_the_input() -> None:
    assert OverCap(True, False, 65601, 65536).description(65536) == (
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
    assert over.description(65536) == (
        what + ": send a smaller input, or start the encoder with a larger --max-message-bytes"
    )
