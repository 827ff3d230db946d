"""Health needs no token, so its Watch streams, which never end on their own, hold at most half of
the places a server has for calls (max_concurrent_rpcs), one past it RESOURCE_EXHAUSTED naming the
bound: without it one caller with no token could hold every place and every Generate, Embed and
kubelet Check was answered RESOURCE_EXHAUSTED. There is no share per address: a gateway watches
each decoder from every caller's channel, all from its one address."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import open_channel
from tandem.common.health import max_watches
from tandem.common.server import RunningServer, ServerOptions, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    # Tokens required for every service but health; 8 calls at once in all, health included.
    options = ServerOptions(
        host="127.0.0.1", port=0, auth_tokens=frozenset({"secret"}), max_concurrent_rpcs=8
    )
    running = await start_server(options, [])
    await running.set_serving()
    try:
        yield running
    finally:
        await running.stop(0)


async def _watch(stub: health_pb2_grpc.HealthStub) -> grpc.aio.UnaryStreamCall:
    """A Watch stream with no token, once its first answer came."""
    stream = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert (await stream.read()).status == SERVING
    return stream


async def _refused(stub: health_pb2_grpc.HealthStub) -> str:
    stream = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return caught.value.details() or ""


def test_watches_hold_half_of_the_places_a_server_has_for_calls() -> None:
    assert [max_watches(n) for n in (1, 2, 8, 10_000)] == [1, 1, 4, 5_000]


async def test_watches_past_the_bound_leave_the_servers_places_to_its_calls(server: RunningServer) -> None:
    """8 places in all, 4 watches at most: a caller with no token cannot take the places of the calls
    (without the bound the 9th call of any kind was RESOURCE_EXHAUSTED)."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(4)]
        refusals = [await _refused(stub) for _ in range(6)]
        assert set(refusals) == {"at most 4 health Watch streams at once; Check answers at once"}
        checks = [stub.Check(health_pb2.HealthCheckRequest(), timeout=5) for _ in range(3)]
        assert [reply.status for reply in await asyncio.gather(*checks)] == [SERVING] * 3
        assert server.health.num_watches == 4
        streams[0].cancel()  # a stream that ends gives its place back
        for _ in range(100):
            if server.health.num_watches == 3:
                break
            await asyncio.sleep(0.01)
        streams.append(await _watch(stub))
        for stream in streams:
            stream.cancel()


async def test_a_gateways_balanced_channel_for_each_of_600_callers_is_served() -> None:
    """A gateway opens a channel of its own per caller (up to --max-connections 512 plus 64 idle), each
    watching the decoders it balances over, all from one address: a bound of 256 watches an address
    failed the 257th caller's calls UNAVAILABLE ("health check call failed")."""
    running = await start_server(ServerOptions(host="127.0.0.1", port=0), [])
    await running.set_serving()
    channels = [
        open_channel(f"dns:///{running.address}", service="", own_connection=True) for _ in range(600)
    ]
    try:
        checks = [
            health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(), timeout=30) for c in channels
        ]
        assert [reply.status for reply in await asyncio.gather(*checks)] == [SERVING] * 600
        assert running.health.num_watches == 600
    finally:
        await asyncio.gather(*(c.close() for c in channels))
        await running.stop(0)
