"""gRPC statuses and the gateway's own refusals -> OpenAI's error shape with the HTTP status clients
expect: `{"error": {"message", "type", "param", "code"}}`. The field a status names (its BadRequest
violation) becomes `param`, in the request body's terms (`chat.messages[0]` -> `messages[0]`), and a
RESOURCE_EXHAUSTED's RetryInfo becomes `Retry-After`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tandem.client.errors import InvalidArgument

# gRPC code -> (HTTP status, OpenAI error type)
STATUSES: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


@dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        code = self.type if self.status != 429 else "rate_limit_exceeded"
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def from_invalid(error: InvalidArgument) -> HttpError:
    return HttpError(400, "invalid_request_error", str(error), error.field)


def from_grpc(error: grpc.aio.AioRpcError) -> HttpError:
    status, kind = STATUSES.get(error.code(), (500, "server_error"))
    param, retry_after = None, None
    try:
        details = rpc_status.from_call(error)  # type: ignore[arg-type]
    except Exception:  # a status without readable details: the code and message still hold
        details = None
    for detail in details.details if details is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            violation = error_details_pb2.BadRequest()
            detail.Unpack(violation)
            if violation.field_violations:
                param = body_field(violation.field_violations[0].field)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_after = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    message = error.details() or error.code().name
    if status == 429 and "larger than max" in message:  # the transport's size limit: not retryable
        return HttpError(413, "invalid_request_error", message)
    if status == 429 and retry_after is None:
        retry_after = 1.0
    return HttpError(status, kind, body_field(message), param, retry_after)


# A service's field path -> the body's (first matching prefix).
BODY_FIELDS = (
    ("chat.messages", "messages"),
    ("].encoder", "].image_url"),  # the gateway sends only image_url parts as encoder parts
    ("stopping.max_new_tokens", "max_tokens"),
    ("stopping.min_new_tokens", "min_tokens"),
    ("stopping.stop_sequences", "stop"),
    ("stopping.ignore_eos", "ignore_eos"),
    ("output.top_logprobs", "top_logprobs"),
    ("output.logprobs", "logprobs"),
    ("sampling.", ""),
    ("structured.", "response_format."),
)


def body_field(path: str) -> str:
    """A service's field path (or a message holding one) as the OpenAI body spells it."""
    for service, body in BODY_FIELDS:
        path = path.replace(service, body)
    return path
