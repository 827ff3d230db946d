"""Health needs no token, so its Watch streams, which never end on their own, are bounded: at most
MAX_WATCHES at once and MAX_WATCHES_PER_PEER from one address, one past either RESOURCE_EXHAUSTED
naming the bound. Without it one caller with no token could hold every place the server counts
(max_concurrent_rpcs) and every Generate, Embed and kubelet Check was answered RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common import health
from tandem.common.health import _address
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


async def test_one_address_holds_at_most_its_share_of_watches_and_checks_go_on(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "MAX_WATCHES_PER_PEER", 3)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(3)]
        assert await _refused(stub) == (
            "at most 3 health Watch streams at once from one address; Check answers at once"
        )
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
        streams[0].cancel()  # a stream that ends gives its place back
        for _ in range(100):
            if server.health.num_watches == 2:
                break
            await asyncio.sleep(0.01)
        streams.append(await _watch(stub))
        for stream in streams:
            stream.cancel()


async def test_watches_past_the_bound_leave_the_servers_places_to_its_calls(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 places in all: 4 watches at most, so a caller with no token cannot take the places of the
    calls that need one (without the bound the 9th call of any kind was RESOURCE_EXHAUSTED)."""
    monkeypatch.setattr(health, "MAX_WATCHES", 4)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(4)]
        refusals = [await _refused(stub) for _ in range(6)]
        assert set(refusals) == {"at most 4 health Watch streams at once; Check answers at once"}
        checks = [stub.Check(health_pb2.HealthCheckRequest(), timeout=5) for _ in range(3)]
        assert [reply.status for reply in await asyncio.gather(*checks)] == [SERVING] * 3
        assert server.health.num_watches == 4
        for stream in streams:
            stream.cancel()


def test_a_peer_is_its_address_without_the_port() -> None:
    assert _address("ipv4:10.0.0.7:53422") == "ipv4:10.0.0.7"
    assert _address("ipv6:[::1]:53422") == "ipv6:[::1]"
    assert _address("unix:/tmp/socket") == "unix:/tmp/socket"
