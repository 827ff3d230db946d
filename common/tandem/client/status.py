"""Domain errors -> gRPC statuses with google.rpc details, and the one interceptor that does it.

Servicers raise `tandem.client.errors` types (or let them propagate from the engine); the interceptor
turns each into its status code with a `BadRequest` field violation or a `RetryInfo`, and its
`ErrorInfo` where it has one, so clients in any language can read the field, the limit, how long to
wait and which refusal it is from the standard details (`status_details.py` reads them back). Anything
else is a bug: logged with its traceback and reported as INTERNAL without leaking internals.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import grpc
from google.protobuf import descriptor_pool, duration_pb2
from google.protobuf.descriptor import Descriptor
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from . import errors, memory
from .bad_utf8 import bad_utf8_field
from .oversized import oversized
from .status_details import status_details

log = logging.getLogger(__name__)

_CODES: list[tuple[type[errors.TandemError], int]] = [
    (errors.InvalidArgument, code_pb2.INVALID_ARGUMENT),
    (errors.FailedPrecondition, code_pb2.FAILED_PRECONDITION),
    (errors.ResourceExhausted, code_pb2.RESOURCE_EXHAUSTED),
    (errors.Unavailable, code_pb2.UNAVAILABLE),
    (errors.DeadlineExceeded, code_pb2.DEADLINE_EXCEEDED),
    (errors.NotFound, code_pb2.NOT_FOUND),
    (errors.AlreadyExists, code_pb2.ALREADY_EXISTS),
    (errors.ModelFault, code_pb2.INTERNAL),
]


# A status travels in trailing metadata, which a grpc client refuses past 8 KiB (its soft limit: some
# calls, then every one past 16 KiB) as RESOURCE_EXHAUSTED "Stream removed", in place of the status.
# The message goes twice (grpc-message, each byte outside printable ASCII percent-encoded as three;
# and grpc-status-details-bin, in base64 beside the field and description), so the bound is in UTF-8
# bytes: 1024 characters of a path or a name in another script than Latin filled 15-20 KiB. At 768
# bytes for each of message, field and description, a status of any script is at most 5.6 KB of
# trailers (1,024 made 7.4 KB, 0.8 KiB short of the limit, with every other trailer to come).
MAX_MESSAGE_BYTES = 768
# An ErrorInfo goes in the same trailer: a reason and a few numbers, under 200 bytes. One passed on from
# another server (the decoder passes an encoder's on) is that server's word, and was sent as it came: an
# encoder's of 5-11 KB took the decoder's trailer past the limit, and 2-11 of 20 callers got
# RESOURCE_EXHAUSTED "received metadata size exceeds soft limit" (a 429) for a 400. At most
# MAX_INFO_BYTES serialized (684 bytes of base64: 6.3 KB of trailers at most, with the message's); a
# reason or domain over MAX_INFO_NAME_BYTES leaves the ErrorInfo out (cut, it would be another reason),
# an entry over its bound or past MAX_INFO_BYTES is dropped.
MAX_INFO_BYTES = 512
MAX_INFO_NAME_BYTES = 64  # a reason, a domain, a metadata key
MAX_INFO_VALUE_BYTES = 128


def _bounded(text: str) -> str:
    # A lone surrogate (JSON's "\udcff" in a file a message quotes) has no UTF-8: written as its escape,
    # else the encode raised inside the interceptor and the caller got UNKNOWN with the exception's text.
    encoded = text.encode("utf-8", "backslashreplace")
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return encoded.decode()
    kept = encoded[:MAX_MESSAGE_BYTES].decode(errors="ignore")  # never half a character
    return f"{kept}... ({len(encoded.decode()) - len(kept)} more characters)"


def to_status_proto(error: errors.TandemError) -> status_pb2.Status:
    code = next((c for cls, c in _CODES if isinstance(error, cls)), code_pb2.INTERNAL)
    status = status_pb2.Status(code=code, message=_bounded(error.message))
    if isinstance(error, errors.InvalidArgument | errors.FailedPrecondition):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=_bounded(error.field), description=_bounded(error.description)
        )
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    elif isinstance(error, errors.ResourceExhausted) and error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    if error.info is not None and (info := _bounded_info(error.info)) is not None:
        status.details.add().Pack(info)
    return status


def _bounded_info(info: errors.ErrorInfo) -> error_details_pb2.ErrorInfo | None:
    """`info` within MAX_INFO_BYTES (see there), its entries in order while they fit; None where its
    reason or domain does not."""
    if not (_fits(info.reason, MAX_INFO_NAME_BYTES) and _fits(info.domain, MAX_INFO_NAME_BYTES)):
        return None
    bounded = error_details_pb2.ErrorInfo(reason=info.reason, domain=info.domain)
    for key, value in info.metadata.items():
        if _fits(key, MAX_INFO_NAME_BYTES) and _fits(value, MAX_INFO_VALUE_BYTES):
            bounded.metadata[key] = value
            if bounded.ByteSize() > MAX_INFO_BYTES:
                del bounded.metadata[key]
    return bounded


def _fits(text: str, max_bytes: int) -> bool:
    # Text with no UTF-8 (a lone surrogate) fits nowhere: protobuf refuses it.
    try:
        return len(text.encode()) <= max_bytes
    except UnicodeEncodeError:
        return False


def field_violation(error: grpc.RpcError) -> tuple[str, str] | None:
    """(field, description) of the first `BadRequest` field violation a status carries; None if none."""
    violations = status_details(error).field_violations
    return violations[0] if violations else None


def error_type(exc: BaseException) -> str:
    """`error.type`: the gRPC status name a client sees (`INVALID_ARGUMENT`, `CANCELLED`, ...), or the
    exception's class name for bugs (which the client sees as INTERNAL)."""
    if isinstance(exc, errors.TandemError):
        return code_pb2.Code.Name(to_status_proto(exc).code)
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code().name
    return type(exc).__qualname__


def end_with(context: grpc.aio.ServicerContext, error: errors.TandemError) -> None:
    """Give the RPC the error's status; the handler then returns, and grpc sends it.

    NOTE: not context.abort(). It raises AbortError through grpc's own frames, which then hold each
    other and the request in a reference cycle that only the cyclic GC frees; an idle server runs it
    rarely, so every refused request kept its memory (about 140 MB for 60 MB of embedding rows) long
    after it ended. For the same reason the error leaves its traceback (its frames hold the request).
    """
    error.__traceback__ = None
    status = rpc_status.to_status(to_status_proto(error))
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)


def end_with_internal(context: grpc.aio.ServicerContext, method: str) -> None:
    log.exception("unhandled error in %s", method)
    context.set_code(grpc.StatusCode.INTERNAL)
    context.set_details(f"internal error in {method}; see the server log")


def _end(context: grpc.aio.ServicerContext, error: errors.TandemError, method: str) -> None:
    """end_with, or INTERNAL where the error cannot become a status (e.g. an ErrorInfo value protobuf
    refuses): a caller gets a status the server chose, never UNKNOWN with the exception's text."""
    try:
        end_with(context, error)
    except Exception:
        end_with_internal(context, method)


def _is_abort(exc: BaseException) -> bool:
    # A servicer's own context.abort() raises AbortError (a BaseException subclass in some versions).
    return isinstance(exc, grpc.aio.AbortError)


class _Malformed:
    """What a request that failed to parse becomes, so the behaviour can answer INVALID_ARGUMENT.

    Left to grpc, a message that does not parse (random bytes, invalid UTF-8 in a string field)
    ends as INTERNAL, which would blame the server for the client's bytes.
    """

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(
    deserializer: Callable[[bytes], Any] | None,
    method: str,
    max_bytes: Callable[[], int | None] | None = None,
) -> Callable[[bytes], Any] | None:
    """`deserializer`, answering a request that does not parse, or is longer than `max_bytes()` says
    the method can use, with a _Malformed (the latter unparsed: client/oversized.py; one whose string
    field is not UTF-8 naming that field: client/bad_utf8.py)."""
    if deserializer is None:
        return None
    descriptor = _request_type(method) or getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)

    def parse(raw: bytes) -> Any:
        bound = max_bytes() if max_bytes is not None else None
        if bound is not None and len(raw) > bound:
            return _Malformed(oversized(raw, bound, descriptor))
        try:
            return deserializer(raw)
        except Exception as error:
            # Only protobuf's own refusal is the walk's to explain; a service's parser (Embed's) refuses
            # with a TandemError that already names its field, whatever its text says.
            if (
                not isinstance(error, errors.TandemError)
                and descriptor is not None
                and "utf-8" in str(error).lower()
            ):
                return _Malformed(_not_utf8(raw, descriptor, method))
            return _Malformed(error)

    return parse


def _request_type(method: str) -> Descriptor | None:
    """The request message type of `method` ("/package.Service/Method") as its proto declares it.

    Read from the method's name, not the deserializer: a service's own parser (the encoder's
    parse_embed, a bound method of its servicer) carries no message type, and Embed's strings went unnamed.
    """
    service, _, name = method[1:].rpartition("/")
    try:
        return descriptor_pool.Default().FindServiceByName(service).methods_by_name[name].input_type
    except KeyError:
        return None  # a service whose proto is not in the default pool: the deserializer's own type


def _not_utf8(raw: bytes, descriptor: Descriptor, method: str) -> errors.InvalidArgument:
    """The refusal of `raw`, a request protobuf refused for a string field that is not UTF-8."""
    field = bad_utf8_field(raw, descriptor)
    if field is not None:
        return errors.InvalidArgument(field, "is not valid UTF-8 (a string field holds UTF-8 text only)")
    return errors.InvalidArgument(
        "request",
        f"not a valid request message for {method}: one of its string fields is not valid UTF-8 "
        "(string fields hold UTF-8 text only; bytes fields take any bytes)",
    )


def _reject_malformed(request: Any, method: str) -> None:
    if isinstance(request, _Malformed):
        # A parser's own refusal keeps its status: the encoder's refuses an image its model cannot take,
        # unparsed, as FAILED_PRECONDITION, as it does a small one parsed.
        if isinstance(request.error, errors.TandemError):
            raise request.error
        raise errors.InvalidArgument("request", f"not a valid request message for {method}: {request.error}")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps TandemError to its status and any other exception to INTERNAL, for every method;
    a request that does not parse is INVALID_ARGUMENT, and so is a call that sends none.

    Unary-request methods are served as request-streaming ones that read their one message here:
    grpc.aio leaves a call that half-closes before sending its request open until the deadline
    (forever without one), where reading the request ourselves can end it. The wire is the same.
    """

    def __init__(self, max_request_bytes: Mapping[str, Callable[[], int | None]] | None = None) -> None:
        # "/package.Service/Method" -> the most bytes its request can usefully have (None: no bound
        # yet); a longer one is refused unparsed (client/oversized.py).
        self._max_request_bytes = dict(max_request_bytes or {})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=_tolerant(
                    handler.request_deserializer, method, self._max_request_bytes.get(method)
                ),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=_tolerant(handler.request_deserializer, method),
                response_serializer=handler.response_serializer,
            )
        return handler


async def _only_request(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str) -> Any:
    """The one request message of a unary-request call; INVALID_ARGUMENT when the call sent none.

    A large one gets its memory given back once the call has ended (tandem.client.memory)."""
    async for request in requests:
        if _num_bytes(request) >= memory.LARGE_REQUEST_BYTES:
            context.add_done_callback(partial(_give_back_soon, asyncio.get_running_loop()))
        return request
    raise errors.InvalidArgument("request", f"the call to {method} ended without a request message")


def _num_bytes(request: Any) -> int:
    """A request's size on the wire: a message's, or raw bytes' for methods registered without one."""
    if isinstance(request, bytes):
        return len(request)
    return request.ByteSize() if hasattr(request, "ByteSize") else 0


def _give_back_soon(loop: asyncio.AbstractEventLoop, _: object) -> None:
    # After grpc has let go of the call, which it does once its done callbacks have run.
    loop.call_soon(memory.give_back)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        try:
            request = await _only_request(requests, context, method)
            _reject_malformed(request, method)
            return await behavior(request, context)
        except errors.TandemError as error:
            _end(context, error, method)
        except Exception as exc:
            if _is_abort(exc):
                raise
            end_with_internal(context, method)
        return None  # discarded: the status is not OK

    return wrapped


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], method: str
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = await _only_request(requests, context, method)
            _reject_malformed(request, method)
            async for response in behavior(request, context):
                yield response
        except errors.TandemError as error:
            _end(context, error, method)
        except Exception as exc:
            if _is_abort(exc):
                raise
            end_with_internal(context, method)

    return wrapped
