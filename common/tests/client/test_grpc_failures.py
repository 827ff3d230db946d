"""gRPC's own failure of a call told from a service's status, and its WARNING lines rate-limited."""

from __future__ import annotations

import logging

import grpc
import pytest

from tandem.client.grpc_failures import STATUS_DETAILS_KEY, WARN_EVERY_S, GrpcsOwnWarnings, is_grpcs_own

log = logging.getLogger(__name__)


def _error(code: grpc.StatusCode, trailer: tuple[tuple[str, str | bytes], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), details="said")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_an_unavailable_or_deadline_without_a_services_status_is_grpcs_own(code: grpc.StatusCode) -> None:
    assert is_grpcs_own(_error(code))


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_status_with_google_rpc_details_is_the_services_own(code: grpc.StatusCode) -> None:
    """Every refusal of a Tandem service's carries its google.rpc.Status: a decoder loading, an encoder
    still loading its model."""
    assert not is_grpcs_own(_error(code, ((STATUS_DETAILS_KEY, b"\x08\x0e"),)))


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED]
)
def test_other_codes_are_never_grpcs_own_failures(code: grpc.StatusCode) -> None:
    assert not is_grpcs_own(_error(code))


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_alike_failures_are_logged_once_per_interval_for_each_service_and_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopped service fails every call: each was a WARNING line of its own, the same words. Now one
    per WARN_EVERY_S for each service and code, the next saying how many went unlogged."""
    clock = _Clock()
    warnings = GrpcsOwnWarnings(log, clock=clock)
    down, late = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED
    with caplog.at_level(logging.WARNING, logger=__name__):
        for _ in range(5):
            warnings.warn("decoder", down, "decoder down")
        warnings.warn("encoder", down, "encoder down")  # another service: its own line
        warnings.warn("decoder", late, "decoder late")  # another code: its own line
        clock.now_s += WARN_EVERY_S - 0.001
        warnings.warn("decoder", down, "decoder down")  # still within the interval
        clock.now_s += 0.001  # the interval passed
        warnings.warn("decoder", down, "decoder down")
        warnings.warn("encoder", down, "encoder down")  # none skipped: no count
    assert [r.getMessage() for r in caplog.records] == [
        "decoder down",
        "encoder down",
        "decoder late",
        "decoder down (5 more since the last such line)",
        "encoder down",
    ]
    assert {r.levelname for r in caplog.records} == {"WARNING"}
