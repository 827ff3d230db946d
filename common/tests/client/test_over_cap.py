"""gRPC's status text for a message over a cap is read as whose cap (the calling side's CLIENT, the
service's SERVER) and which message (the request, the reply). Any other failure is no message over a
cap. (What each service says of each case is specified with it: the decoder's test_encoder_over_cap.py,
the gateway's test_errors.py.)"""

from __future__ import annotations

import grpc
import pytest

from tandem.client.over_cap import OverCap, over_cap


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
