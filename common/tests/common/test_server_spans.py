"""A tracing service's gRPC server span: a child of its caller's `traceparent` (read by the services'
rules: a repeated one is none), current while the handler runs, and ending with the code its caller
gets as `rpc.grpc.status_code`, ERROR only for the codes the RPC conventions call a server's error. A
stream its caller cancels or whose deadline passes used to end with code 0 and no status."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem.client import telemetry as otel
from tandem.client.errors import InvalidArgument
from tandem.client.status import ErrorInterceptor
from tandem.client.telemetry.server_spans import (
    DEADLINE_SLACK_S,
    RPC_GRPC_STATUS_CODE,
    ServerSpans,
    call_code,
    is_past_deadline,
)
from tandem.common.server import ServerOptions, Service, start_server

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER_PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4737-00f067aa0ba902b8-01"
SERVICE = "test.Spans"


def _identity(x: bytes) -> bytes:
    return x


class Methods:
    """Raw-bytes methods, served behind the services' ErrorInterceptor as the services serve theirs."""

    def __init__(self) -> None:
        self.current: list[trace.SpanContext] = []  # the current span each handler saw

    async def Echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.current.append(trace.get_current_span().get_span_context())
        return request

    async def Refuse(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise InvalidArgument("prompt", "too long")

    async def Bug(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RuntimeError("a bug")

    async def Hang(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.Event().wait()  # until grpc cancels it


@dataclass
class Traced:
    stub: Callable[[str], Any]  # a method's name -> its multicallable
    spans: InMemorySpanExporter
    methods: Methods

    async def span(self) -> ReadableSpan:
        """The one server span, once ended: it ends just after the caller sees the status."""
        async with asyncio.timeout(5):
            while not self.spans.get_finished_spans():
                await asyncio.sleep(0.005)
        (span,) = self.spans.get_finished_spans()
        self.spans.clear()
        return span


@pytest.fixture
async def traced() -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-encoder", [SimpleSpanProcessor(exporter)])
    methods = Methods()
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(methods.Echo, _identity, _identity),
        "Refuse": grpc.unary_unary_rpc_method_handler(methods.Refuse, _identity, _identity),
        "Bug": grpc.unary_unary_rpc_method_handler(methods.Bug, _identity, _identity),
        "Hang": grpc.unary_stream_rpc_method_handler(methods.Hang, _identity, _identity),
    }
    server = grpc.aio.server(interceptors=[*telemetry.server_interceptors(), ErrorInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    def stub(name: str) -> Any:
        path = f"/{SERVICE}/{name}"
        make = channel.unary_stream if name == "Hang" else channel.unary_unary
        return make(path, request_serializer=_identity, response_deserializer=_identity)

    try:
        yield Traced(stub, exporter, methods)
    finally:
        await channel.close()
        await server.stop(0)


class _FailingProcessor(SimpleSpanProcessor):
    """A span processor that fails at each span's end, as an exporter's fault would."""

    def __init__(self) -> None:
        super().__init__(InMemorySpanExporter())

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("the exporter failed")


async def test_a_span_that_fails_to_end_leaves_the_call_its_own_outcome() -> None:
    # OpenTelemetry's SDK raises a processor's error from span.end(): raised from the handler's finally,
    # it made a call served UNKNOWN to its caller.
    telemetry = otel.build_telemetry("tandem-encoder", [_FailingProcessor()])
    methods = Methods()
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(methods.Echo, _identity, _identity)}
    server = grpc.aio.server(interceptors=[*telemetry.server_interceptors(), ErrorInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(f"/{SERVICE}/Echo", _identity, _identity)
            assert await echo(b"hi", timeout=5) == b"hi"
    finally:
        await server.stop(0)


async def test_a_call_is_a_child_of_its_callers_traceparent_and_current_in_its_handler(
    traced: Traced,
) -> None:
    assert await traced.stub("Echo")(b"hi", metadata=[("traceparent", PARENT)]) == b"hi"
    span = await traced.span()
    assert (span.name, span.kind) == (f"/{SERVICE}/Echo", SpanKind.SERVER)
    assert span.parent is not None and span.parent.trace_id == int(PARENT.split("-")[1], 16)
    assert traced.methods.current == [span.context]
    a = span.attributes
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"]) == ("grpc", SERVICE, "Echo")
    assert (a["network.transport"], a["network.type"]) == ("tcp", "ipv4")
    assert a["network.peer.address"] == a["client.address"] == "127.0.0.1"
    assert a["network.peer.port"] == a["client.port"] and a["client.port"] > 0  # type: ignore[operator]
    assert a["user_agent.original"].startswith("grpc-python")  # type: ignore[union-attr]
    assert not [k for k in a if k.startswith("net.peer.")]  # deprecated: replaced, not duplicated
    assert a[RPC_GRPC_STATUS_CODE] == 0 and span.status.status_code is StatusCode.UNSET


async def test_repeated_tracestates_are_joined_and_bounded_together(traced: Traced) -> None:
    echo = traced.stub("Echo")
    await echo(b"", metadata=[("traceparent", PARENT), ("tracestate", "a=1"), ("tracestate", "b=2")])
    assert (await traced.span()).context.trace_state.to_header() == "a=1,b=2"
    long = [("tracestate", "k=" + "v" * 255), ("tracestate", "j=" + "v" * 255), ("tracestate", "i=1")]  # 519
    await echo(b"", metadata=[("traceparent", PARENT), *long, ("x-bin", b"\x00")])
    span = await traced.span()
    assert span.parent is not None and len(span.context.trace_state) == 0  # over 512 characters: dropped


async def test_a_repeated_traceparent_is_no_parent() -> None:
    # The instrumentation's own kept the last value of each key, and took it. (grpc 1.85 itself keeps
    # only the last traceparent of a call it sends or takes: this one reaches the handler from another
    # stack.)
    exporter = InMemorySpanExporter()
    spans = _spans(exporter)
    metadata = (("traceparent", PARENT), ("traceparent", OTHER_PARENT))
    handler = await spans.intercept_service(_returning(_echo), _Details(f"/{SERVICE}/Echo"))  # type: ignore[arg-type]
    assert await handler.unary_unary(b"", _Context(None, metadata)) == b""
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no words for it")


async def _unprintable(request: bytes, context: Any) -> bytes:
    raise _Unprintable


async def test_a_span_whose_attributes_fail_to_be_set_is_ended_all_the_same() -> None:
    # Recording a failure that cannot be put in words raised before span.end(): the span stayed open.
    exporter = InMemorySpanExporter()
    handler = await _spans(exporter).intercept_service(
        _returning(_unprintable),
        _Details(f"/{SERVICE}/Echo"),  # type: ignore[arg-type]
    )
    with pytest.raises(_Unprintable):
        await handler.unary_unary(b"", _Context(None))
    (span,) = exporter.get_finished_spans()
    assert span.attributes[RPC_GRPC_STATUS_CODE] == grpc.StatusCode.UNKNOWN.value[0]


async def test_a_stream_its_caller_cancels_is_cancelled_and_no_server_error(traced: Traced) -> None:
    call = traced.stub("Hang")(b"")
    assert await call.read() == b"first"
    call.cancel()
    span = await traced.span()
    assert span.attributes[RPC_GRPC_STATUS_CODE] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code is StatusCode.UNSET


async def test_a_stream_past_its_deadline_is_deadline_exceeded_and_a_server_error(traced: Traced) -> None:
    call = traced.stub("Hang")(b"", timeout=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    span = await traced.span()
    assert span.attributes[RPC_GRPC_STATUS_CODE] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert span.status.status_code is StatusCode.ERROR


async def test_a_refusal_keeps_its_code_with_no_server_error_and_a_bug_is_an_internal_error(
    traced: Traced,
) -> None:
    for name, code, status in (
        ("Refuse", grpc.StatusCode.INVALID_ARGUMENT, StatusCode.UNSET),
        ("Bug", grpc.StatusCode.INTERNAL, StatusCode.ERROR),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await traced.stub(name)(b"")
        assert caught.value.code() is code
        span = await traced.span()
        assert (span.attributes[RPC_GRPC_STATUS_CODE], span.status.status_code) == (code.value[0], status)


class _Context:
    """A servicer context: its deadline, if any, `remaining_s` away, its call's `metadata` and `peer`."""

    def __init__(
        self,
        remaining_s: float | None,
        metadata: tuple[tuple[str, str], ...] = (),
        peer: str = "ipv4:127.0.0.1:5000",
    ) -> None:
        self.remaining_s = remaining_s
        self.metadata = metadata
        self.peer_address = peer

    def time_remaining(self) -> float | None:
        return self.remaining_s

    def code(self) -> grpc.StatusCode | None:
        return None

    def details(self) -> str:
        return ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return self.peer_address


def _spans(exporter: InMemorySpanExporter) -> ServerSpans:
    telemetry = otel.build_telemetry("tandem-decoder", [SimpleSpanProcessor(exporter)])
    (spans,) = telemetry.server_interceptors()
    assert isinstance(spans, ServerSpans)
    return spans


async def _echo(request: bytes, context: Any) -> bytes:
    return request


def _returning(behavior: Any, is_stream: bool = False) -> Callable[[Any], Awaitable[grpc.RpcMethodHandler]]:
    """An interceptor's continuation that finds `behavior` as the method's handler."""

    async def continuation(details: Any) -> grpc.RpcMethodHandler:
        if is_stream:
            return grpc.unary_stream_rpc_method_handler(behavior)
        return grpc.unary_unary_rpc_method_handler(behavior)

    return continuation


@dataclass
class _Details:
    """What grpc tells interceptors of a call."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...] = ()


def test_a_handler_ended_by_cancel_or_close_is_cancelled_or_past_its_deadline() -> None:
    for failure in (asyncio.CancelledError(), GeneratorExit()):
        assert call_code(_Context(None), failure) is grpc.StatusCode.CANCELLED  # type: ignore[arg-type]
        assert call_code(_Context(3.0), failure) is grpc.StatusCode.CANCELLED  # type: ignore[arg-type]
        assert call_code(_Context(0.0), failure) is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[arg-type]


def test_a_call_cut_with_a_moment_of_the_servers_time_left_was_cut_by_its_deadline() -> None:
    # The server's deadline starts when it receives the call, after its caller's: grpc cut calls whose
    # deadline had passed with 0.04 to 3.7 ms of the server's time left, and their spans said CANCELLED.
    for remaining_s, code in (
        (0.004, grpc.StatusCode.DEADLINE_EXCEEDED),
        (DEADLINE_SLACK_S, grpc.StatusCode.DEADLINE_EXCEEDED),
        (DEADLINE_SLACK_S + 0.01, grpc.StatusCode.CANCELLED),
    ):
        context = _Context(remaining_s)
        assert is_past_deadline(context) is (code is grpc.StatusCode.DEADLINE_EXCEEDED)  # type: ignore[arg-type]
        assert call_code(context, asyncio.CancelledError()) is code  # type: ignore[arg-type]


def test_a_call_the_servers_stop_cut_is_unavailable_even_within_the_deadlines_slack() -> None:
    # The stop's cut is known, the deadline's guessed: a call with 10 ms left that the stop cut was
    # DEADLINE_EXCEEDED, where its caller got UNAVAILABLE.
    for failure in (asyncio.CancelledError(), GeneratorExit()):
        for remaining_s in (None, 3.0, 0.01, 0.0):
            context = _Context(remaining_s)
            assert call_code(context, failure, is_stop_cut=True) is grpc.StatusCode.UNAVAILABLE  # type: ignore[arg-type]
    # A call the stop marked that ended by itself ends as it ended.
    assert call_code(_Context(0.01), None, is_stop_cut=True) is grpc.StatusCode.OK  # type: ignore[arg-type]


async def test_the_stop_marks_the_calls_running_when_it_cuts_them_and_no_later_one() -> None:
    exporter = InMemorySpanExporter()
    spans = _spans(exporter)

    async def hang(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.Event().wait()

    handler = await spans.intercept_service(_returning(hang, is_stream=True), _Details(f"/{SERVICE}/Hang"))  # type: ignore[arg-type]
    cut = handler.unary_stream(b"", _Context(0.01))  # within the deadline's slack: still the stop's cut
    assert await anext(cut) == b"first"
    spans.on_calls_cut()
    later = handler.unary_stream(b"", _Context(3.0))
    assert await anext(later) == b"first"
    await cut.aclose()
    await later.aclose()
    codes = [
        (s.attributes[RPC_GRPC_STATUS_CODE], s.status.status_code) for s in exporter.get_finished_spans()
    ]
    assert codes == [
        (grpc.StatusCode.UNAVAILABLE.value[0], StatusCode.ERROR),
        (grpc.StatusCode.CANCELLED.value[0], StatusCode.UNSET),
    ]


async def test_a_peer_is_named_by_the_current_conventions_ipv6_unbracketed_a_unix_caller_by_transport() -> (
    None
):
    exporter = InMemorySpanExporter()
    handler = await _spans(exporter).intercept_service(_returning(_echo), _Details(f"/{SERVICE}/Echo"))  # type: ignore[arg-type]
    for peer, expected in (
        (
            "ipv4:10.0.0.7:5000",
            {"network.type": "ipv4", "network.peer.address": "10.0.0.7", "client.port": 5000},
        ),
        (
            "ipv6:%5B::1%5D:5000",
            {"network.type": "ipv6", "network.peer.address": "::1", "client.address": "::1"},
        ),
        ("unix:/run/tandem.sock", {"network.transport": "unix", "network.peer.address": "/run/tandem.sock"}),
        ("unix:", {"network.transport": "unix"}),
    ):
        await handler.unary_unary(b"", _Context(None, peer=peer))
        (span,) = exporter.get_finished_spans()
        exporter.clear()
        assert {k: span.attributes.get(k) for k in expected} == expected, peer
    assert "client.address" not in span.attributes  # a unix socket's caller has no name


def _hanging(exporter: InMemorySpanExporter) -> tuple[ServerOptions, Service]:
    """A server's options with the services' tracing (spans to `exporter`) and a service whose Hang
    stream sends one reply, then waits until it is cut."""
    telemetry = otel.build_telemetry("tandem-decoder", [SimpleSpanProcessor(exporter)])
    methods = Methods()

    def add(servicer: object, server: grpc.aio.Server) -> None:
        handler = grpc.unary_stream_rpc_method_handler(methods.Hang, _identity, _identity)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Hang": handler}),))

    return ServerOptions(port=0, interceptors=telemetry.server_interceptors()), Service(SERVICE, None, add)


async def test_a_stream_the_servers_stop_cuts_is_unavailable_and_an_error_one_its_caller_left_is_not() -> (
    None
):
    # Its caller gets UNAVAILABLE ("Cancelling all calls") once the stop's grace has passed; the span said
    # CANCELLED, unset, as if the caller had left. A caller that leaves during the grace did leave.
    exporter = InMemorySpanExporter()
    options, service = _hanging(exporter)
    running = await start_server(options, [service])
    async with grpc.aio.insecure_channel(running.address) as channel:
        hang = channel.unary_stream(
            f"/{SERVICE}/Hang", request_serializer=_identity, response_deserializer=_identity
        )
        left, cut = hang(b"", timeout=30), hang(b"", timeout=30)
        assert await left.read() == b"first" and await cut.read() == b"first"
        stopping = asyncio.create_task(running.stop(grace_s=0.3, notice_s=0))
        await asyncio.sleep(0.05)
        left.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cut.read()
        await stopping
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    async with asyncio.timeout(5):  # each ends once its cancelled handler has unwound
        while len(exporter.get_finished_spans()) < 2:
            await asyncio.sleep(0.005)
    codes = sorted(
        (s.attributes[RPC_GRPC_STATUS_CODE], s.status.status_code) for s in exporter.get_finished_spans()
    )
    assert codes == [
        (grpc.StatusCode.CANCELLED.value[0], StatusCode.UNSET),
        (grpc.StatusCode.UNAVAILABLE.value[0], StatusCode.ERROR),
    ]


async def test_a_stop_marks_only_the_calls_it_cut_not_those_of_a_server_started_after_it() -> None:
    # One ServerOptions serves a server started again in the same process (the reliability harness
    # restarts its decoder so). The first stop cut nothing, yet its mark stayed on the interceptor: a
    # caller's own cancel on the second server was UNAVAILABLE, an error.
    exporter = InMemorySpanExporter()
    options, service = _hanging(exporter)
    first = await start_server(options, [service])
    await first.stop(grace_s=0, notice_s=0)  # gRPC's cut at once, with no call to cut
    second = await start_server(options, [service])
    try:
        async with grpc.aio.insecure_channel(second.address) as channel:
            hang = channel.unary_stream(
                f"/{SERVICE}/Hang", request_serializer=_identity, response_deserializer=_identity
            )
            call = hang(b"", timeout=30)
            assert await call.read() == b"first"
            call.cancel()
            async with asyncio.timeout(5):  # it ends once its cancelled handler has unwound
                while not exporter.get_finished_spans():
                    await asyncio.sleep(0.005)
    finally:
        await second.stop(grace_s=0, notice_s=0)
    (span,) = exporter.get_finished_spans()
    assert span.attributes[RPC_GRPC_STATUS_CODE] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code is StatusCode.UNSET


async def test_a_stream_grpc_lets_go_between_replies_ends_its_span_when_asyncio_closes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # grpc cancels its task while it writes a reply: the handler is left at a `yield`, and asyncio's
    # finalizer closes it later, in a task of its own (GeneratorExit, as 93001e1 saw on a loaded box).
    exporter = InMemorySpanExporter()
    closed: list[trace.Span] = []

    async def replies(request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"first"
            yield b"second"
        finally:
            closed.append(trace.get_current_span())

    handler = await _spans(exporter).intercept_service(
        _returning(replies, is_stream=True),
        _Details(f"/{SERVICE}/Hang"),  # type: ignore[arg-type]
    )
    stream = handler.unary_stream(b"", _Context(0.0))
    assert await anext(stream) == b"first"
    with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
        await asyncio.create_task(stream.aclose())
    (span,) = exporter.get_finished_spans()
    assert span.attributes[RPC_GRPC_STATUS_CODE] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert span.status.status_code is StatusCode.ERROR
    assert closed and not caplog.records  # the handler was closed first; no "Failed to detach context"
