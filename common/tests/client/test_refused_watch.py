"""A balanced channel whose health Watch a serving server refuses (its address's share of Watch
streams, or the server's, taken by others: `tandem.common.health`) is served all the same: the
refusal is UNIMPLEMENTED, which gRPC's client-side health checking (gRFC A17) takes as "this server
does not watch, call it", where any other status kept the connection out of rotation, retried with
backoff, so a caller with no token holding an address's 256 places failed every balanced channel
opened from there after it ("health check call failed"). A replica that does not serve yet (loading)
refuses RESOURCE_EXHAUSTED and stays out of rotation until it serves. What the refused channel loses
is health-based routing on that connection: a draining replica it still leaves, as the replica's
connections close, and a watching one loses no call to it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tests.client.replica import Replica
from tandem.client.client import DecoderClient, EncoderClient
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2_grpc
from tandem.common import running_server
from tandem.common.health import MAX_WATCHES_PER_ADDRESS
from tandem.common.server import RunningServer, ServerOptions, Service, start_server


async def _start(
    replica: Replica, max_concurrent_rpcs: int = 600, max_connection_age_s: float = 600.0
) -> RunningServer:
    services = [
        Service("tandem.v1.Decoder", replica, decoder_pb2_grpc.add_DecoderServicer_to_server),
        Service("tandem.v1.Encoder", replica, encoder_pb2_grpc.add_EncoderServicer_to_server),
    ]
    options = ServerOptions(
        host="127.0.0.1",
        port=0,
        max_concurrent_rpcs=max_concurrent_rpcs,
        max_connection_age_s=max_connection_age_s,
    )
    running = await start_server(options, services)
    running.health.max_wait_s = 0.05  # a Watch past a bound is refused at once, as the tests hold it
    await running.set_serving()
    return running


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[list[Replica], list[RunningServer]]]:
    replicas = [Replica("a"), Replica("b")]
    servers = [await _start(replica) for replica in replicas]
    try:
        yield replicas, servers
    finally:
        await asyncio.gather(*(server.stop(0) for server in servers))


@contextlib.asynccontextmanager
async def _watches_held(servers: Sequence[RunningServer], num_watches: int) -> AsyncIterator[None]:
    """`num_watches` Watch streams held on each server from 127.0.0.1, as a caller with no token
    holds them, each with its first answer (SERVING or not); on leaving, closed and seen to end on
    each server still running (a server stopped with Watch handlers running logs their cancel)."""
    attackers = [grpc.aio.insecure_channel(server.address) for server in servers]
    try:
        stubs = [health_pb2_grpc.HealthStub(attacker) for attacker in attackers]
        streams = [stub.Watch(health_pb2.HealthCheckRequest()) for stub in stubs for _ in range(num_watches)]
        await asyncio.gather(*(stream.read() for stream in streams))
        yield
    finally:
        await asyncio.gather(*(attacker.close() for attacker in attackers))
        for _ in range(200):
            if all(server.health.num_watches == 0 for server in servers):
                break
            await asyncio.sleep(0.01)


async def _generated_by(client: DecoderClient, num_calls: int) -> collections.Counter[str]:
    async def one() -> str:
        stream = client.stub.Generate(decoder_pb2.GenerateRequest(), timeout=10)
        return (await stream.read()).request_id

    return collections.Counter([await one() for _ in range(num_calls)])


async def _until_both_serve(client: DecoderClient) -> None:
    """Both replicas in the channel's rotation. Each refused Watch ends after its wait for a place
    (WATCH_PLACE_WAIT_S), one a few ms after the other, and only then does round_robin take that
    replica: 4 calls back to back all went to the first in 2 of ~21 runs on a loaded 2-core host."""
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(40):
        seen += await _generated_by(client, 2)
        if set(seen) == {"a", "b"}:
            return
        await asyncio.sleep(0.05)
    assert set(seen) == {"a", "b"}


def _balanced(servers: Sequence[RunningServer]) -> str:
    return ",".join(server.address for server in servers)


async def test_a_client_from_an_address_whose_watches_are_all_taken_is_served(
    replicas: tuple[list[Replica], list[RunningServer]],
) -> None:
    """Someone behind the client's own address (a NAT, the same host, a node's /64) holds its 256
    Watch places on both replicas; a DecoderClient and an EncoderClient opened after it balance over
    both (refused RESOURCE_EXHAUSTED, every call was UNAVAILABLE 'health check call failed')."""
    _, servers = replicas
    async with (
        _watches_held(servers, MAX_WATCHES_PER_ADDRESS),
        DecoderClient(_balanced(servers)) as decoder,
        EncoderClient(_balanced(servers)) as encoder,
    ):
        assert set(await _generated_by(decoder, 6)) == {"a", "b"}
        embedded = [(await encoder.embed(text="x", timeout=10)).request_id for _ in range(6)]
        assert set(embedded) == {"a", "b"}
        assert [server.health.num_watches for server in servers] == [MAX_WATCHES_PER_ADDRESS] * 2


async def test_a_client_opened_when_every_watch_place_of_the_server_is_taken_is_served() -> None:
    """8 places for calls, 4 for Watch streams, all 4 held: a new balanced channel (a dns: name, one
    server) is served, and its calls still find the other 4 places."""
    replica = Replica("a")
    server = await _start(replica, max_concurrent_rpcs=8)
    try:
        async with _watches_held([server], 4), DecoderClient(f"dns:///127.0.0.1:{server.port}") as client:
            assert await _generated_by(client, 3) == {"a": 3}
            assert server.health.num_watches == 4
    finally:
        await server.stop(0)


async def test_wait_serving_asks_with_check_when_its_watch_is_refused(
    replicas: tuple[list[Replica], list[RunningServer]],
) -> None:
    """wait_serving watches health; refused (UNIMPLEMENTED while serving, RESOURCE_EXHAUSTED while
    not) it raised though the server served. It asks with Check instead, which is never refused: it
    waits while the server loads and returns once it serves."""
    _, servers = replicas
    server = servers[0]
    async with _watches_held([server], MAX_WATCHES_PER_ADDRESS), DecoderClient(server.address) as client:
        await client.wait_serving(timeout=10)  # refused UNIMPLEMENTED: it serves
        await server.set_serving(False)
        with pytest.raises(TimeoutError):
            await client.wait_serving(timeout=0.5)  # refused RESOURCE_EXHAUSTED, Check: NOT_SERVING
        waiting = asyncio.ensure_future(client.wait_serving(timeout=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await server.set_serving()
        await asyncio.wait_for(waiting, 10)


async def test_a_refused_client_calls_a_loading_replica_only_once_it_serves(
    replicas: tuple[list[Replica], list[RunningServer]],
) -> None:
    """A replica loading (NOT_SERVING, answering Generate UNAVAILABLE) refuses the channel's Watch
    RESOURCE_EXHAUSTED: none of the channel's calls go there (refused UNIMPLEMENTED, the channel sent
    it half its calls, each retried on the other until retry throttling failed them). gRPC asks the
    Watch again after about 1 s, answered UNIMPLEMENTED once the replica serves."""
    replica_list, servers = replicas
    replica_list[1].is_loading = True
    await servers[1].set_serving(False)
    for server in servers:
        server.health.max_watches_per_address = 1  # the share, smaller: one stream takes it
    async with _watches_held(servers, 1), DecoderClient(_balanced(servers)) as client:
        assert await _generated_by(client, 6) == {"a": 6}
        assert replica_list[1].num_refused == 0
        replica_list[1].is_loading = False
        await servers[1].set_serving()
        for _ in range(60):  # the Watch asked again: 1 s +-20% after its refusal
            if "b" in await _generated_by(client, 1):
                break
            await asyncio.sleep(0.05)
        assert set(await _generated_by(client, 4)) == {"a", "b"}


async def test_a_refused_client_leaves_a_draining_replica(
    replicas: tuple[list[Replica], list[RunningServer]],
) -> None:
    """Without a Watch the channel does not see a draining replica's NOT_SERVING; it leaves it as the
    replica's connection closes, and calls made back to back all through the drain are served by
    the other. The odd call that reaches the replica's gRPC at the very instant it stops is ended
    CANCELLED, never retried (gRPC core cancels a call that arrives after its shutdown began): the
    drain notice in server.py is for watching clients, and this one hears only gRPC's GOAWAY."""
    replica_list, servers = replicas
    for server in servers:
        server.health.max_watches_per_address = 1  # the share, smaller: one stream takes it
    async with _watches_held(servers, 1), DecoderClient(_balanced(servers)) as client:
        await _until_both_serve(client)
        served, failed = await _calling_through_a_drain(client, servers[1], grace_s=0.5)
        assert served["a"] > served["b"] > 0
        assert set(failed) <= {grpc.StatusCode.CANCELLED} and len(failed) <= NUM_CALLERS
        assert await _generated_by(client, 4) == {"a": 4}


async def test_a_watching_client_loses_no_call_to_a_draining_replica(
    replicas: tuple[list[Replica], list[RunningServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draining replica says NOT_SERVING and takes calls for its drain notice before gRPC's stop:
    a watching channel's calls made back to back all through the drain are all served, those picked
    before it heard by the replica, the rest by the other. Stopping at once lost a call, CANCELLED,
    in 5-6 drains of 20. The notice is made a second here, so that a busy machine's loop has time."""
    monkeypatch.setattr(running_server, "DRAIN_NOTICE_S", 1.0)
    _, servers = replicas
    async with DecoderClient(_balanced(servers)) as client:
        assert set(await _generated_by(client, 4)) == {"a", "b"}
        served, failed = await _calling_through_a_drain(client, servers[1], grace_s=1.5)
        assert failed == []
        assert served["a"] > served["b"] > 0
        assert await _generated_by(client, 4) == {"a": 4}


NUM_CALLERS = 4


async def _calling_through_a_drain(
    client: DecoderClient, server: RunningServer, grace_s: float
) -> tuple[collections.Counter[str], list[grpc.StatusCode]]:
    """`NUM_CALLERS` callers making calls back to back from before `server.stop(grace_s)` until it
    returns: which replica served how many, and how each failed call ended."""
    draining: asyncio.Future[None] | None = None
    failed: list[grpc.StatusCode] = []

    async def calling() -> collections.Counter[str]:
        served = collections.Counter[str]()
        while draining is None or not draining.done():
            try:
                served += await _generated_by(client, 1)
            except grpc.aio.AioRpcError as error:
                failed.append(error.code())
        return served

    callers = [asyncio.ensure_future(calling()) for _ in range(NUM_CALLERS)]
    await asyncio.sleep(0.1)
    draining = asyncio.ensure_future(server.stop(grace_s))  # its grace ends a held Watch
    served = sum(await asyncio.gather(*callers), collections.Counter[str]())
    return served, failed


async def test_a_client_refused_for_a_moment_watches_again_once_its_connection_ages_out() -> None:
    """Refused once while the replicas served, a channel's health checking is off for its
    connection's life: whoever held the places need not stay, and a replica failing afterwards
    (NOT_SERVING, its Generate UNAVAILABLE) kept its share of first attempts for ever (95 of 200
    calls failed once retry throttling ran out, 100 of 200 thirty seconds later). The server asks a
    connection to go after max_connection_age_s (one second here); reconnected, the channel watches
    again and leaves the failed replica."""
    replica_list = [Replica("a"), Replica("b")]
    servers = [await _start(replica, max_connection_age_s=1.0) for replica in replica_list]
    try:
        async with _watches_held(servers, MAX_WATCHES_PER_ADDRESS):
            client = DecoderClient(_balanced(servers))
            assert sum((await _generated_by(client, 4)).values()) == 4  # refused, served all the same
        async with client:
            replica_list[1].is_loading = True
            await servers[1].set_serving(False)
            async with asyncio.timeout(20):
                while True:
                    replica_list[1].num_refused = 0
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await _generated_by(client, 10)
                    if replica_list[1].num_refused == 0:
                        break
                    await asyncio.sleep(0.2)
            assert await _generated_by(client, 10) == {"a": 10}
    finally:
        await asyncio.gather(*(server.stop(0) for server in servers))
