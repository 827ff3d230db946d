"""The gRPC server span of each call a tracing service serves, ending as its caller sees the call.

NOTE: the span is Tandem's own, made over public APIs only. The instrumentation's aio server interceptor
(opentelemetry-instrumentation-grpc) made it, subclassed to override its private `_set_remote_context`,
and it was wrong twice:
- a stream that its caller cancelled, or whose deadline passed, ended as it had begun, code 0 and
  status unset: the instrumentation records only the code a handler sets on its context, and grpc ends
  such a handler by CancelledError, or by GeneratorExit when it closes the stream between two replies;
- an upgrade that stopped calling the private hook (the package is pinned with no upper bound) would
  silently have read a repeated header as its last value, taking the last of two `traceparent`s.
Here the caller's context is read from every value of a repeated header (propagation.py's rules), and
the span ends with the code its caller gets (`call_code`) and the status the RPC conventions give a
gRPC server for it. Its name and `rpc.*` attributes are the instrumentation's (`/package.Service/Method`,
`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`), the names its client spans, which
Tandem's clients use, still carry. Its caller is named by the current, stable names (`client.*`,
`network.*`, `user_agent.original`), not the instrumentation's server span's `net.peer.*` (deprecated
since 2023 at the latest) and `rpc.user_agent` (in no convention): nothing of Tandem's read them, no
collector rule or dashboard here either, so they were replaced outright, not emitted beside the new
names for a while (docs/DEPLOYMENT.md says why).

grpc keeps only the last `traceparent` of a call (its core holds it as `W3CTraceParentMetadata`, not
repeatable) before any Python code sees the metadata: two sent raw over HTTP/2 reach grpc 1.85's
`invocation_metadata` as the last alone, in the interceptor and the servicer's context alike. So a
repeated `traceparent` is refused here only where it arrives repeated (a server behind another stack),
as the gateway, over HTTP, refuses it always.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import attach, detach
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

# What grpc.aio calls for one method: (request or request iterator, context).
Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
# True = the call gets a span (tandem.client.telemetry.providers: health checks and excluded services not).
CallFilter = Callable[[grpc.HandlerCallDetails], bool]

RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
USER_AGENT_ORIGINAL = "user_agent.original"
# The caller: the address its connection came from (grpc knows no intermediary), as both the client's
# (`client.*`) and the connection's peer (`network.peer.*`), as the RPC conventions ask of a server span.
CLIENT_ADDRESS = "client.address"
CLIENT_PORT = "client.port"
NETWORK_PEER_ADDRESS = "network.peer.address"
NETWORK_PEER_PORT = "network.peer.port"
NETWORK_TRANSPORT = "network.transport"  # "tcp" | "unix"
NETWORK_TYPE = "network.type"  # "ipv4" | "ipv6", for tcp
# The codes the RPC semantic conventions call a gRPC server's error; the others (CANCELLED,
# INVALID_ARGUMENT, NOT_FOUND, ...) are its caller's doing and leave the status unset.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


# How close to its deadline, on the server's clock, a cut call counts as cut by it. The server's deadline
# starts when it receives the call's headers, after its caller's, so grpc cuts a call whose deadline
# passed with a little of the server's time still left: 0.04 to 3.7 ms in 9 of 200 calls on a loaded
# loopback (8 streams beside them), each of them CANCELLED and no error where its caller got
# DEADLINE_EXCEEDED. 50 ms covers that lag more than ten times over, and a one-way trip within a region;
# what it costs is a caller that cancels its own call in the last 50 ms before its deadline, counted as
# the deadline's, which the server cannot tell apart.
DEADLINE_SLACK_S = 0.05


def is_past_deadline(context: grpc.aio.ServicerContext) -> bool:
    """Whether a call grpc cut (its handler ended by CancelledError or GeneratorExit) was cut by its
    deadline, as its caller sees it: the one rule for the server span and the services' own spans."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def call_code(
    context: grpc.aio.ServicerContext, failure: BaseException | None, is_stop_cut: bool = False
) -> grpc.StatusCode:
    """The code the caller gets for a handler that ended by `failure` (None: it returned);
    `is_stop_cut`: the server's stop cut the call (`ServerSpans.on_calls_cut`)."""
    if isinstance(failure, (asyncio.CancelledError, GeneratorExit)):
        # grpc cancels a call its caller cancelled, one whose deadline passed and one its stop cut alike.
        # The stop's cut first: it is certain, where the deadline's rule guesses within DEADLINE_SLACK_S,
        # and a call with less than that left when the stop cut it is UNAVAILABLE to its caller.
        if is_stop_cut:
            return grpc.StatusCode.UNAVAILABLE
        return grpc.StatusCode.DEADLINE_EXCEEDED if is_past_deadline(context) else grpc.StatusCode.CANCELLED
    code = context.code()  # set_code or abort's (an ErrorInterceptor's end_with sets it); None if neither
    if code is not None:
        return code
    # grpc answers an exception the handler let out, abort's aside, UNKNOWN.
    is_unknown = failure is not None and not isinstance(failure, grpc.aio.AbortError)
    return grpc.StatusCode.UNKNOWN if is_unknown else grpc.StatusCode.OK


@dataclass(eq=False)  # each call its own, in a set by identity
class _Call:
    """A traced call in flight."""

    is_stop_cut: bool = False  # the server's stop cut it (`ServerSpans.on_calls_cut`)


class ServerSpans(grpc.aio.ServerInterceptor):
    """One SERVER span per call that `is_traced` accepts, current while its handler runs."""

    def __init__(self, tracer: trace.Tracer, is_traced: CallFilter) -> None:
        self._tracer = tracer
        self._is_traced = is_traced
        self._live: set[_Call] = set()  # the calls whose handlers run, for `on_calls_cut`

    def on_calls_cut(self) -> None:
        """The server's stop has run out of grace and cancels every call still running, each ending
        UNAVAILABLE for its caller ("Cancelling all calls"), a server error: without this they ended
        CANCELLED with no error, as if their callers had left. `RunningServer.stop`
        (tandem.common.running_server) calls it at that moment, not at the stop's start: a caller that
        leaves during the grace left.

        Only the calls running now are marked: the interceptor outlives the server (one ServerOptions
        serves a server started again in the same process, as the reliability harness restarts its
        decoder), and a call of a later server that its caller cancels is its caller's. A server
        sharing this interceptor while another stops would have its calls marked too: none does."""
        for call in self._live:
            call.is_stop_cut = True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not self._is_traced(handler_call_details):
            return handler
        behavior, make_handler = _behavior(handler)
        method = handler_call_details.method
        if inspect.isasyncgenfunction(behavior):
            traced: Behavior = self._traced_stream(behavior, method)
        elif inspect.iscoroutinefunction(behavior):
            traced = self._traced_call(behavior, method)
        else:  # a sync handler runs in grpc's thread pool, outside this loop's context: none here
            return handler
        return make_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _traced_call(self, behavior: Behavior, method: str) -> Behavior:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span, token = self._start(method, context)
            call = self._enter()
            failure: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as error:
                failure = error
                raise
            finally:
                detach(token)
                self._live.discard(call)
                _end(span, context, failure, call.is_stop_cut)

        return traced

    def _traced_stream(self, behavior: Behavior, method: str) -> Behavior:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span, token = self._start(method, context)
            call = self._enter()
            task = asyncio.current_task()
            failure: BaseException | None = None
            try:
                # Closed here when grpc closes this one: the handler's own spans end before the server's.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except BaseException as error:
                failure = error
                raise
            finally:
                # A stream grpc let go between two replies is closed by asyncio's finalizer in a task of
                # its own, where the call's context is not current (detaching there only logs an error).
                if asyncio.current_task() is task:
                    detach(token)
                self._live.discard(call)
                _end(span, context, failure, call.is_stop_cut)

        return traced

    def _start(self, method: str, context: grpc.aio.ServicerContext) -> tuple[Span, object]:
        carrier: dict[str, list[str]] = {}  # every value of a repeated header, for the propagator
        for key, value in context.invocation_metadata() or ():
            if isinstance(value, str):  # binary (-bin) headers carry no trace context
                carrier.setdefault(key, []).append(value)
        parent = propagate.extract(carrier)
        attributes = _attributes(method, carrier, context.peer())
        span = self._tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return span, attach(trace.set_span_in_context(span, parent))

    def _enter(self) -> _Call:
        call = _Call()
        self._live.add(call)
        return call


def _behavior(handler: grpc.RpcMethodHandler) -> tuple[Behavior, Callable[..., grpc.RpcMethodHandler]]:
    """The handler's behaviour and the factory that makes a handler of its kind around another."""
    if handler.request_streaming and handler.response_streaming:
        return handler.stream_stream, grpc.stream_stream_rpc_method_handler
    if handler.request_streaming:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    if handler.response_streaming:
        return handler.unary_stream, grpc.unary_stream_rpc_method_handler
    return handler.unary_unary, grpc.unary_unary_rpc_method_handler


def _attributes(method: str, carrier: dict[str, list[str]], peer: str) -> dict[str, str | int]:
    service, _, name = method.lstrip("/").partition("/")
    attributes: dict[str, str | int] = {RPC_SYSTEM: "grpc", RPC_SERVICE: service, RPC_METHOD: name}
    if agents := carrier.get("user-agent"):
        attributes[USER_AGENT_ORIGINAL] = agents[-1]
    return {**attributes, **_peer_attributes(peer)}


def _peer_attributes(peer: str) -> dict[str, str | int]:
    """The caller's attributes from grpc's peer: "ipv4:127.0.0.1:57284", "ipv6:%5B::1%5D:57284" (the
    first of a list), "unix:/path" or "unix:" (a unix socket's caller has no name)."""
    scheme, _, address = peer.split(",")[0].partition(":")
    if scheme == "unix":
        return {NETWORK_TRANSPORT: "unix", **({NETWORK_PEER_ADDRESS: address} if address else {})}
    if scheme not in ("ipv4", "ipv6"):
        return {}
    host, _, port = unquote(address).rpartition(":")
    ip = host.removeprefix("[").removesuffix("]")  # the conventions' IPv6 address is unbracketed
    attributes: dict[str, str | int] = {
        NETWORK_TRANSPORT: "tcp",
        NETWORK_TYPE: scheme,
        NETWORK_PEER_ADDRESS: ip,
        CLIENT_ADDRESS: ip,
    }
    if port.isascii() and port.isdigit():  # str.isdigit takes '²', which int() refuses
        attributes[NETWORK_PEER_PORT] = attributes[CLIENT_PORT] = int(port)
    return attributes


def _end(
    span: Span, context: grpc.aio.ServicerContext, failure: BaseException | None, is_stop_cut: bool
) -> None:
    """Ends the call's span; what that raises (a span processor's fault: OpenTelemetry's SDK passes it
    on from `span.end()`) is logged, never the call's: it was raised from the handler's `finally`, and a
    call served was UNKNOWN to its caller."""
    try:
        _end_span(span, context, failure, is_stop_cut)
    except Exception:
        log.exception("a call's server span failed to end")


def _end_span(
    span: Span, context: grpc.aio.ServicerContext, failure: BaseException | None, is_stop_cut: bool
) -> None:
    # Ended whatever setting its attributes raises (a failure whose `__str__` raises, recorded): the span
    # stayed open, its trace incomplete.
    try:
        code = call_code(context, failure, is_stop_cut)
        details = context.details() if code is context.code() else None
        if code is grpc.StatusCode.UNAVAILABLE and is_stop_cut and details is None:
            details = "the server stopped before the call ended"
        span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
        if isinstance(failure, Exception) and not isinstance(failure, grpc.aio.AbortError):
            span.record_exception(failure)
        if code in SERVER_ERROR_CODES:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
    finally:
        span.end()
