"""The shared server bootstrap: health, reflection, the error interceptor and graceful stop."""

import asyncio
import logging
import re
import threading
import time
from collections import Counter

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from common.tests.common.listeners import (
    has_ipv6_loopback,
    pick_taken_before_the_bind,
    pick_taken_first,
    second_loopback,
)
from tandem.client import bad_utf8, errors, memory
from tandem.client import error_reasons as reasons
from tandem.client.channel import channel_options
from tandem.client.errors import ConfigError
from tandem.client.status_details import status_details
from tandem.common import listening, running_server
from tandem.common import server as server_module
from tandem.common.call_over_filter import GRPC_LOGGER
from tandem.common.running_server import RunningServer
from tandem.common.server import Service, start_server
from tandem.common.server_options import MAX_CONNECTION_AGE_S, MIN_CONNECTION_AGE_S, ServerOptions

MAX_BYTES = 1024 * 1024


def _identity(x: bytes) -> bytes:
    return x


class Faulty:
    """A raw-bytes service whose methods fail the ways real servicers can."""

    async def BadInput(self, request: bytes, context) -> bytes:
        raise errors.InvalidArgument("prompt[0].text", "must not be empty")

    async def Quoting(self, request: bytes, context) -> bytes:  # as "path: <the caller's path> is not..."
        raise errors.InvalidArgument("path", f"{request.decode()} is not a directory")

    async def Echo(self, request: bytes, context) -> bytes:
        return request

    async def Bug(self, request: bytes, context) -> bytes:
        raise RuntimeError("secret internal detail")

    async def Stream(self, request: bytes, context):
        yield b"first"
        raise errors.ResourceExhausted("queue full", retry_after_s=1.0)

    async def LostSend(self, requests, context):
        async for _ in requests:
            break
        yield b"first"
        # What grpc.aio's own write raises when the call ended on the wire (its client left) before
        # grpc saw the client's cancel: the same error, through the same handler, raised here at will.
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')

    async def Slow(self, request: bytes, context):
        for _ in range(10):
            await asyncio.sleep(0.05)
            yield b"tick"


def _add_faulty(servicer: Faulty, server: grpc.aio.Server) -> None:
    unary = {
        "BadInput": servicer.BadInput,
        "Quoting": servicer.Quoting,
        "Echo": servicer.Echo,
        "Bug": servicer.Bug,
    }
    stream = {"Stream": servicer.Stream, "Slow": servicer.Slow}
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn, _identity, _identity) for name, fn in unary.items()
    } | {name: grpc.unary_stream_rpc_method_handler(fn, _identity, _identity) for name, fn in stream.items()}
    # Request-streaming, so that the error interceptor leaves it as it is: grpc's own handling is tested.
    handlers["LostSend"] = grpc.stream_stream_rpc_method_handler(servicer.LostSend, _identity, _identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Faulty", handlers),))


@pytest.fixture
async def running():
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_BYTES),
        [Service("test.Faulty", Faulty(), _add_faulty)],
    )
    yield server
    await server.stop(0)


def _channel(server: RunningServer) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(server.address, options=channel_options(MAX_BYTES))


async def test_health_is_not_serving_until_the_service_says_ready(running: RunningServer) -> None:
    async with _channel(running) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ["", "test.Faulty"]:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await running.set_serving()
        reply = await health.Check(health_pb2.HealthCheckRequest(service="test.Faulty"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_services(running: RunningServer) -> None:
    async with _channel(running) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        call = stub.ServerReflectionInfo(iter([request]), timeout=5)
        names = [s.name async for reply in call for s in reply.list_services_response.service]
    assert {"test.Faulty", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(names)


async def test_domain_error_becomes_status_with_field_violation(running: RunningServer) -> None:
    async with _channel(running) as channel:
        call = channel.unary_unary("/test.Faulty/BadInput")(b"", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = await rpc_status.aio.from_call(call)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "prompt[0].text"


@pytest.mark.parametrize(
    "character", ["a", "%", "\u8a9e", "\U0001f600"], ids=["ascii", "percent", "cjk", "emoji"]
)
async def test_a_status_quoting_a_long_input_in_any_script_reaches_the_client_as_itself(
    running: RunningServer, character: str
) -> None:
    # A client refuses trailing metadata past 8 KiB (grpc's soft limit: at random up to 16 KiB, then
    # always) as RESOURCE_EXHAUSTED "Stream removed": 4 KB of a CJK path filled 15 KiB. The channel
    # here refuses all past 8 KiB, so that a status at risk fails every time, not at random.
    options = [("grpc.max_metadata_size", 8192), ("grpc.absolute_max_metadata_size", 8192)]
    async with grpc.aio.insecure_channel(running.address, options=options) as channel:
        call = channel.unary_unary("/test.Faulty/Quoting")((character * 4000).encode(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert caught.value.details().startswith(f"path: {character * 100}")
        status = await rpc_status.aio.from_call(call)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "path"


async def test_unexpected_exception_is_internal_without_leaking_details(running: RunningServer) -> None:
    async with _channel(running) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/test.Faulty/Bug")(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in caught.value.details()


async def test_error_mid_stream_ends_the_stream_with_its_status(running: RunningServer) -> None:
    async with _channel(running) as channel:
        call = channel.unary_stream("/test.Faulty/Stream")(b"", timeout=5)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for message in call:
                received.append(message)
        assert received == [b"first"]
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = await rpc_status.aio.from_call(call)
    assert status.code == code_pb2.RESOURCE_EXHAUSTED


async def test_oversized_message_is_refused_with_resource_exhausted(running: RunningServer) -> None:
    options = channel_options(4 * MAX_BYTES)
    async with grpc.aio.insecure_channel(running.address, options=options) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/test.Faulty/BadInput")(b"x" * (2 * MAX_BYTES), timeout=5)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_graceful_stop_finishes_in_flight_streams_and_refuses_new_ones(running: RunningServer) -> None:
    await running.set_serving()
    async with _channel(running) as channel:
        call = channel.unary_stream("/test.Faulty/Slow")(b"", timeout=10)
        assert await call.read() == b"tick"
        stopping = asyncio.create_task(running.stop(grace_s=5.0))
        rest = []
        while (message := await call.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert len(rest) == 9
        assert await call.code() == grpc.StatusCode.OK
        await stopping
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/test.Faulty/BadInput")(b"", timeout=2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_stopping_server_says_not_serving_and_still_takes_calls_during_its_drain_notice(
    running: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notice, made long here so that nothing in the test races it: health is NOT_SERVING at once
    and a new call is served, so a balanced client that has not heard yet loses nothing (gRPC's stop
    at once cancelled the calls that reached it after its shutdown began: CANCELLED, never retried)."""
    monkeypatch.setattr(running_server, "DRAIN_NOTICE_S", 60.0)
    await running.set_serving()
    stopping = asyncio.create_task(running.stop(grace_s=120.0))
    try:
        async with _channel(running) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="test.Faulty"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await channel.unary_unary("/test.Faulty/Echo")(b"late", timeout=5) == b"late"
        assert not stopping.done()
    finally:
        stopping.cancel()  # the fixture's stop(0) ends the server: no notice at grace 0


async def test_a_stops_drain_notice_counts_within_its_grace(
    running: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop takes no longer than its grace, notice included: with a stream running, a grace
    shorter than the notice ends the stop when it runs out, not after the notice (60 s here), so
    `--grace-s` and the terminationGracePeriod set from it hold; grace 0 has no notice at all."""
    monkeypatch.setattr(running_server, "DRAIN_NOTICE_S", 60.0)
    await running.set_serving()
    async with _channel(running) as channel:
        call = channel.unary_stream("/test.Faulty/Slow")(b"", timeout=10)  # 0.5 s of ticks
        assert await call.read() == b"tick"
        await asyncio.wait_for(running.stop(grace_s=0.1), 10)
        call.cancel()
        await asyncio.wait_for(running.stop(grace_s=0), 10)


async def test_bytes_that_do_not_parse_are_invalid_argument_not_internal(running: RunningServer) -> None:
    async with _channel(running) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/grpc.health.v1.Health/Check")(b"\x0a\x02\x80", timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid request message for /grpc.health.v1.Health/Check" in caught.value.details()


async def test_a_string_field_that_is_not_utf8_is_named(
    running: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Field 1 (service, a string) holding bytes that are not UTF-8: protobuf's parser says only "String
    # field had bad UTF-8", and the refusal named `request` (tandem.client.bad_utf8 finds the field).
    not_utf8 = b"\x0a\x02\xff\xfe"
    async with _channel(running) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(not_utf8, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert status_details(caught.value).field_violations == (
            ("service", "is not valid UTF-8 (a string field holds UTF-8 text only)"),
        )
        # Past the walk's bound, the refusal says which kind of field must be UTF-8.
        monkeypatch.setattr(bad_utf8, "MAX_FIELDS_WALKED", 0)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(not_utf8, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status_details(caught.value).field_violations == (
        (
            "request",
            "not a valid request message for /grpc.health.v1.Health/Check: one of its string fields is "
            "not valid UTF-8 (string fields hold UTF-8 text only; bytes fields take any bytes)",
        ),
    )


@pytest.mark.parametrize(
    "method", ["/test.Faulty/BadInput", "/test.Faulty/Slow", "/grpc.health.v1.Health/Check"]
)
async def test_a_call_that_half_closes_without_a_request_is_invalid_argument_at_once(
    running: RunningServer, method: str
) -> None:
    # grpc.aio by itself leaves such a call open until its deadline: 1,000 of them were still open
    # after a minute. A raw stream call sends no message and then half-closes.
    async with _channel(running) as channel:
        call = channel.stream_stream(method)(timeout=30)
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without a request message" in caught.value.details()


async def test_a_large_request_gives_its_memory_back_once_the_call_has_ended(
    running: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused 60 MB requests used to stay in gRPC's reference cycles and glibc's arenas: the decoder
    # grew by about 75 MB per request and kept it.
    calls: list[float] = []
    monkeypatch.setattr(memory, "give_back", lambda: calls.append(asyncio.get_running_loop().time()))
    monkeypatch.setattr(memory, "LARGE_REQUEST_BYTES", 256 * 1024)  # what the 1 MiB test server takes
    async with _channel(running) as channel:
        for size in (1024, memory.LARGE_REQUEST_BYTES // 2):
            with pytest.raises(grpc.aio.AioRpcError):
                await channel.unary_unary("/test.Faulty/BadInput")(bytes(size), timeout=10)
        await asyncio.sleep(0.2)
        assert calls == []  # small requests cost nothing
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/test.Faulty/BadInput")(bytes(memory.LARGE_REQUEST_BYTES), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in channel.unary_stream("/test.Faulty/Stream")(
                bytes(memory.LARGE_REQUEST_BYTES), timeout=10
            ):
                pass
        for _ in range(50):
            if len(calls) == 2:
                break
            await asyncio.sleep(0.05)
    assert len(calls) == 2


async def test_a_send_that_fails_on_a_call_already_over_logs_no_traceback(
    running: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Cancelling 640 unread streams logged 59 "ExecuteBatchError raised in core" tracebacks.
    async with grpc.aio.insecure_channel(running.address) as channel:
        call = channel.stream_stream("/test.Faulty/LostSend")(iter([b""]), timeout=1.0)
        with caplog.at_level(logging.DEBUG, logger=GRPC_LOGGER):
            assert await call.read() == b"first"
            # No status follows (the call is over for grpc): the deadline ends it, long after the
            # handler failed.
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
    errors = [r for r in caplog.records if r.name == GRPC_LOGGER and r.levelno >= logging.WARNING]
    assert not errors, caplog.text
    logging.getLogger(GRPC_LOGGER).error("any other error")  # still logged
    assert "any other error" in caplog.text


async def test_a_burst_the_server_has_not_taken_up_yet_is_served_not_cancelled(
    running: RunningServer,
) -> None:
    # 1,500 calls arrive while the event loop is busy (it takes calls up one at a time): gRPC core
    # holds them until it is free. Its default queue of such calls dropped them at random past 1,000,
    # each CANCELLED as if its caller had cancelled it (about 60 of these).
    num_calls = 1500
    sent = threading.Event()
    codes: Counter[grpc.StatusCode] = Counter()

    def burst() -> None:
        with grpc.insecure_channel(running.address) as channel:
            echo = channel.unary_unary("/test.Faulty/Echo")
            calls = [echo.future(b"x", timeout=30) for _ in range(num_calls)]
            sent.set()
            codes.update(call.code() for call in calls)

    client = threading.Thread(target=burst)
    client.start()
    assert sent.wait(timeout=30)
    time.sleep(0.5)  # the event loop held, on purpose: the calls reach the server and wait there
    await asyncio.to_thread(client.join)
    assert codes == {grpc.StatusCode.OK: num_calls}


async def test_calls_past_max_concurrent_rpcs_are_resource_exhausted_and_running_streams_go_on() -> None:
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_BYTES, max_concurrent_rpcs=3),
        [Service("test.Faulty", Faulty(), _add_faulty)],
    )
    try:
        async with _channel(server) as channel:
            streams = [channel.unary_stream("/test.Faulty/Slow")(b"", timeout=5) for _ in range(3)]
            for stream in streams:
                assert await stream.read() == b"tick"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/test.Faulty/Echo")(b"x", timeout=5)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.details() == (  # grpc.aio's own says "Concurrent RPC limit exceeded!"
                "this server runs at most 3 calls at once (streams and health checks included); retry later"
            )
            # In the domain of the server's service, as the decoder's own refusals are in tandem.decoder.
            said = status_details(caught.value)
            assert said.info == errors.ErrorInfo(reasons.CALL_LIMIT, "test.faulty", {reasons.MAX_CALLS: "3"})
            assert said.retry_delay_s == 1.0
            # A cancelled stream gives its place back, once the server has seen the cancel.
            streams[0].cancel()
            for _ in range(100):
                try:
                    assert await channel.unary_unary("/test.Faulty/Echo")(b"x", timeout=5) == b"x"
                    break
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.01)
            else:
                pytest.fail("the cancelled stream's place never came back")
            for stream in streams[1:]:
                assert [await stream.read() for _ in range(9)] == [b"tick"] * 9
                assert await stream.read() is grpc.aio.EOF
                assert await stream.code() == grpc.StatusCode.OK
            # Ended streams give their places back.
            replies = [channel.unary_unary("/test.Faulty/Echo")(b"x", timeout=5) for _ in range(3)]
            assert await asyncio.gather(*replies) == [b"x"] * 3
    finally:
        await server.stop(0)


class Listening(grpc.aio.ServerInterceptor):
    """A CutListener that intercepts nothing: it counts the cuts it hears of, or fails at each."""

    def __init__(self, is_failing: bool = False) -> None:
        self.is_failing = is_failing
        self.num_cuts = 0

    async def intercept_service(self, continuation, handler_call_details):
        return await continuation(handler_call_details)

    def on_calls_cut(self) -> None:
        if self.is_failing:
            raise RuntimeError("a listener failed")
        self.num_cuts += 1


async def test_a_cut_listener_that_raises_leaves_the_others_told(caplog: pytest.LogCaptureFixture) -> None:
    # The first one's exception ended the loop over them: those after it never heard of the cut, and
    # counted the calls it cut as their callers' cancels.
    told_first, failing, told_after = Listening(), Listening(is_failing=True), Listening()
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, interceptors=(told_first, failing, told_after)),
        [Service("test.Faulty", Faulty(), _add_faulty)],
    )
    with caplog.at_level(logging.ERROR, logger=running_server.__name__):
        await server.stop(0)
    assert (told_first.num_cuts, told_after.num_cuts) == (1, 1)
    assert "Listening failed to hear of the stop's cut" in caplog.text


@pytest.mark.parametrize("age", [MIN_CONNECTION_AGE_S, MAX_CONNECTION_AGE_S])
async def test_a_server_starts_with_the_connection_ages_at_either_end_of_the_range(age: float) -> None:
    server = await start_server(ServerOptions(host="127.0.0.1", port=0, max_connection_age_s=age), [])
    await server.stop(0)


async def test_a_server_starts_with_the_largest_message_cap_grpc_takes() -> None:
    server = await start_server(ServerOptions(port=0, max_message_bytes=2**31 - 1), [])
    await server.stop(0)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this machine")
@pytest.mark.parametrize("host", ["::1", "::"])
async def test_a_server_listens_on_an_ipv6_host(host: str) -> None:
    """gRPC read "::1:50778" as no address: the start failed, naming --port."""
    server = await start_server(ServerOptions(host=host, port=0), [])
    try:
        async with grpc.aio.insecure_channel(f"[::1]:{server.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await server.stop(0)


async def test_a_host_that_does_not_resolve_is_named_even_on_port_0() -> None:
    """Port 0 skipped the check, and gRPC's failure to bind was said of --port."""
    with pytest.raises(ConfigError, match=r"^host 'no.such.invalid' does not resolve") as caught:
        await start_server(ServerOptions(host="no.such.invalid", port=0), [])
    assert caught.value.field == "host"


async def _answers(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this machine: localhost is one address")
async def test_port_0_on_localhost_listens_on_both_loopbacks_even_where_the_kernels_pick_is_taken_on_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC takes the kernel's pick for localhost's first address and listens on the others where it
    can: one CI start got a port another process held on 127.0.0.1, listened on ::1 alone, and its
    callers of 127.0.0.1 waited on the other process. Such a pick is passed over."""
    with second_loopback() as other:
        taken = other.getsockname()[1]
        picks = pick_taken_first(monkeypatch, taken)
        server = await start_server(ServerOptions(host="localhost", port=0), [])
        try:
            assert picks[0] == taken and server.port == picks[-1] != taken
            assert await _answers(f"127.0.0.1:{server.port}") and await _answers(f"[::1]:{server.port}")
        finally:
            await server.stop(0)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this machine: localhost is one address")
async def test_a_port_taken_at_one_loopback_after_the_check_is_another_port_or_a_refusal_never_half_a_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the check (or port 0's pick) and gRPC's bind another process took the port on one
    loopback: gRPC listened on the other alone. Each address is now bound on its own: port 0 is
    built again on another port; a port asked for is refused naming it and the address."""
    with second_loopback() as other:
        taken = other.getsockname()[1]
        pick_taken_before_the_bind(monkeypatch, server_module, taken)
        server = await start_server(ServerOptions(host="localhost", port=0), [])
        try:
            assert server.port != taken
            assert await _answers(f"127.0.0.1:{server.port}") and await _answers(f"[::1]:{server.port}")
        finally:
            await server.stop(0)

        monkeypatch.setattr(server_module, "check_port_free", lambda host, port: None)  # taken since it ran
        second = listening.listen_plan("localhost").addresses[1][1]
        refusal = (
            rf"^port {taken} is in use on localhost \({re.escape(second)}\): another process listens there$"
        )
        with pytest.raises(ConfigError, match=refusal) as caught:
            await start_server(ServerOptions(host="localhost", port=taken), [])
        assert caught.value.field == "port"


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this machine: localhost is one address")
async def test_a_server_that_loses_its_port_at_one_address_holds_no_service_while_it_lets_the_others_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server bound at one loopback before the other refused is started and stopped to let its
    socket go: it held the services and a health that said SERVING, and callers of that loopback were
    served (or cut) meanwhile. The services are added only to the server that bound every address."""
    built: list[grpc.aio.Server] = []
    served: list[grpc.aio.Server] = []
    real_bare, real_serve = server_module._bare_server, server_module._serve
    monkeypatch.setattr(server_module, "_bare_server", lambda *a: built.append(real_bare(*a)) or built[-1])
    monkeypatch.setattr(
        server_module, "_serve", lambda server, *a: served.append(server) or real_serve(server, *a)
    )
    with second_loopback() as other:
        taken = other.getsockname()[1]
        pick_taken_before_the_bind(monkeypatch, server_module, taken)
        server = await start_server(ServerOptions(host="localhost", port=0), [])
        try:
            assert len(built) == 2 and served == [built[1]] and server.port != taken
        finally:
            await server.stop(0)
