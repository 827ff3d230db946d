"""The bound on a server's calls at once: one past it is RESOURCE_EXHAUSTED naming the bound, never
grpc.aio's "Concurrent RPC limit exceeded!" (which names none), even for a burst that arrives while
the event loop is held, with the details a program reads (ErrorInfo CALL_LIMIT, RetryInfo); and a call
keeps its place exactly while grpc.aio counts it, so none is lost or leaked: one whose request never
comes holds it until it ends, one that fails or is refused gives it back, and so does one whose
call-end hooks raise."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo
from tandem.client.status_details import status_details
from tandem.common.call_bound import RETRY_AFTER_S, CallBound, grpc_bound

GRPC_REFUSAL = "Concurrent RPC limit exceeded!"
REFUSAL = "this server runs at most {:,} calls at once (streams and health checks included); retry later"
DOMAIN = "test.bound"


def _identity(x: bytes) -> bytes:
    return x


class Methods:
    """Raw-bytes methods: a slow stream, an echo, a bug, and a call that reads its requests to the end."""

    async def Slow(self, request: bytes, context) -> AsyncIterator[bytes]:
        for _ in range(5):
            await asyncio.sleep(0.05)
            yield b"tick"

    async def Echo(self, request: bytes, context) -> bytes:
        return request

    async def Bug(self, request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.INTERNAL, "a bug")

    async def Drain(self, requests: AsyncIterator[bytes], context) -> bytes:
        return b"".join([request async for request in requests])


class HooksRaising(grpc.aio.ServerInterceptor):
    """Every call's end hooks raise: a done callback on its context, and its wrapper's own end (as a
    span whose exporter fails)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        behavior = handler.unary_unary

        async def ending_badly(request: bytes, context) -> bytes:
            context.add_done_callback(lambda _: 1 / 0)
            try:
                return await behavior(request, context)
            finally:
                raise RuntimeError("a call-end hook failed")

        return grpc.unary_unary_rpc_method_handler(ending_badly, _identity, _identity)


async def _serve(bound: CallBound, *others: grpc.aio.ServerInterceptor) -> tuple[grpc.aio.Server, str]:
    methods = Methods()
    handlers = {
        "Slow": grpc.unary_stream_rpc_method_handler(methods.Slow, _identity, _identity),
        "Echo": grpc.unary_unary_rpc_method_handler(methods.Echo, _identity, _identity),
        "Bug": grpc.unary_unary_rpc_method_handler(methods.Bug, _identity, _identity),
        "Drain": grpc.stream_unary_rpc_method_handler(methods.Drain, _identity, _identity),
    }
    server = grpc.aio.server(
        interceptors=[bound, *others], maximum_concurrent_rpcs=grpc_bound(bound.max_calls)
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Bound", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _settled(bound: CallBound, num_calls: int) -> None:
    """Waits (at most 5 s) for the server to have seen calls end: their tasks finish after the reply."""
    for _ in range(500):
        if bound.num_calls == num_calls:
            return
        await asyncio.sleep(0.01)
    assert bound.num_calls == num_calls


async def test_a_call_past_the_bound_is_refused_naming_it_and_ended_calls_give_places_back() -> None:
    bound = CallBound(2, DOMAIN)
    server, address = await _serve(bound)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for _ in range(10):  # failing calls hold nothing once they have ended
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await channel.unary_unary("/test.Bound/Bug")(b"x", timeout=5)
                assert failed.value.code() == grpc.StatusCode.INTERNAL
            streams = [channel.unary_stream("/test.Bound/Slow")(b"", timeout=5) for _ in range(2)]
            for stream in streams:
                assert await stream.read() == b"tick"
            for _ in range(10):  # nor do refused ones
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary("/test.Bound/Echo")(b"x", timeout=5)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert refused.value.details() == REFUSAL.format(2)
                # Its reason and when to retry, for a program: it said neither, unlike the engine's
                # QUEUE_FULL, and could not be told from another RESOURCE_EXHAUSTED but by its message.
                said = status_details(refused.value)
                assert said.info == ErrorInfo(reasons.CALL_LIMIT, DOMAIN, {reasons.MAX_CALLS: "2"})
                assert said.retry_delay_s == RETRY_AFTER_S == 1.0
            assert bound.num_calls == 2
            for stream in streams:
                assert [await stream.read() for _ in range(5)] == [b"tick"] * 4 + [grpc.aio.EOF]
                assert await stream.code() == grpc.StatusCode.OK
            await _settled(bound, 0)
            assert await channel.unary_unary("/test.Bound/Echo")(b"x", timeout=5) == b"x"
    finally:
        await server.stop(0)


async def test_a_call_whose_request_never_comes_holds_its_place_until_it_ends() -> None:
    # grpc.aio counts such a call from its start (a unary method's request is read before its
    # handler runs); counted only once a handler ran, it would let grpc.aio's bound answer first.
    bound = CallBound(1, DOMAIN)
    server, address = await _serve(bound)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            silent = channel.stream_unary("/test.Bound/Drain")(timeout=5)
            await _settled(bound, 1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/test.Bound/Echo")(b"x", timeout=5)
            assert refused.value.details() == REFUSAL.format(1)
            silent.cancel()
            await _settled(bound, 0)
            assert await channel.unary_unary("/test.Bound/Echo")(b"x", timeout=5) == b"x"
    finally:
        await server.stop(0)


async def test_a_burst_arriving_while_the_loop_is_held_is_refused_naming_the_bound_never_by_grpc() -> None:
    # grpc.aio counts a call from when it makes the call's task, CallBound once the task runs: between
    # the two are the calls of a burst whose tasks the loop has made and not run (grpc_bound's room).
    bound = CallBound(20, DOMAIN)
    server, address = await _serve(bound)
    num_calls = 600
    sent = threading.Event()
    said: Counter[str] = Counter()

    def burst() -> None:
        with grpc.insecure_channel(address) as channel:
            calls = [channel.unary_stream("/test.Bound/Slow")(b"", timeout=30) for _ in range(num_calls)]
            sent.set()
            for call in calls:
                try:
                    said["OK" if len(list(call)) == 5 else "short"] += 1
                except grpc.RpcError as error:
                    said[error.details()] += 1

    client = threading.Thread(target=burst)
    client.start()
    try:
        assert sent.wait(timeout=30)
        time.sleep(0.3)  # the event loop held, on purpose: the calls reach the server and wait there
        await asyncio.to_thread(client.join)
    finally:
        await server.stop(0)
    assert GRPC_REFUSAL not in said and "short" not in said, said
    assert said["OK"] >= 20 and said["OK"] + said[REFUSAL.format(20)] == num_calls, said


async def test_a_call_whose_end_hooks_raise_gives_its_place_back() -> None:
    bound = CallBound(1, DOMAIN)
    server, address = await _serve(bound, HooksRaising())
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await channel.unary_unary("/test.Bound/Echo")(b"x", timeout=5)
                assert failed.value.code() == grpc.StatusCode.UNKNOWN
                await _settled(bound, 0)
    finally:
        await server.stop(0)


def test_grpcs_own_bound_stays_above_ours() -> None:
    for max_calls in (1, 3, 64, 10_000, 202_176):
        assert grpc_bound(max_calls) >= max_calls + 64
