"""The google.rpc details of a failed call, read back: what `tandem.client.status` puts in the
`grpc-status-details-bin` trailer (BadRequest, RetryInfo, ErrorInfo), for a caller to branch on.

One reader serves both APIs: a sync stub's grpc.RpcError and grpc.aio's AioRpcError are each a
finished call whose trailers are at hand. A status from a server that sends no details (or details
that do not parse) reads as none, so a caller falls back to its code and message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from .errors import ErrorInfo


@dataclasses.dataclass(frozen=True)
class StatusDetails:
    # BadRequest's (field, description) pairs: the request fields at fault, in the service's terms.
    field_violations: tuple[tuple[str, str], ...] = ()
    retry_delay_s: float | None = None  # RetryInfo's: how long to wait before the same call may succeed
    info: ErrorInfo | None = None  # ErrorInfo's: which refusal, and its numbers

    def metadata_of(self, domain: str, reason: str) -> Mapping[str, str] | None:
        """The ErrorInfo's numbers where it gives `reason` of `domain`; None for any other refusal."""
        if self.info is None or (self.info.domain, self.info.reason) != (domain, reason):
            return None
        return self.info.metadata


def status_details(error: grpc.RpcError) -> StatusDetails:
    """The details `error` (sync or aio) carries; empty where it carries none."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except Exception:  # details that do not parse, or not of this status: the code and message still hold
        return StatusDetails()
    violations: list[tuple[str, str]] = []
    retry_delay_s, info = None, None
    for detail in status.details if status is not None else ():
        # A detail whose bytes do not parse as its type is skipped, the others still read: a hostile or
        # broken peer's trailer must not turn a refusal into a crash (a gateway 500, a CLI traceback).
        try:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations += [(v.field, v.description) for v in bad_request.field_violations]
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_delay_s = retry.retry_delay.ToNanoseconds() / 1e9
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                error_info = error_details_pb2.ErrorInfo()
                detail.Unpack(error_info)
                info = ErrorInfo(error_info.reason, error_info.domain, dict(error_info.metadata))
        except DecodeError:
            continue
    return StatusDetails(tuple(violations), retry_delay_s, info)
