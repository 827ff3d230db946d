"""The gateway watches each decoder replica's health once for all its callers, and each caller's own
channel balances over the replicas that serve: a replica that is not serving gets none of their
calls, one that turns SERVING gets its share, and however many callers there are, a replica sees one
Watch stream from the gateway, so one address's share of Watch streams (256) never refuses them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.gateway.callers import CallerChannels, decoder_channels
from tandem.gateway.config import GatewayConfig
from tandem.gateway.replicas import name_of, resolve_name, static_replicas

from .fake_decoder import FakeDecoder

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


class CountingDecoder(FakeDecoder):
    """The fake decoder, counting the GetModelInfo calls it answered."""

    num_infos: int = 0

    async def GetModelInfo(
        self, request: decoder_pb2.DecoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderGetModelInfoResponse:
        self.num_infos += 1
        return await super().GetModelInfo(request, context)


@pytest.fixture
async def replicas() -> AsyncIterator[list[tuple[CountingDecoder, RunningServer]]]:
    """Two decoders as `tandem serve decoder` serves them (bounded health, 600 places for calls, 300
    for Watch streams), SERVING, each on 127.0.0.1 and ::1: two addresses on one machine."""
    started = []
    try:
        for _ in range(2):
            decoder = CountingDecoder()
            service = Service("tandem.v1.Decoder", decoder, decoder_pb2_grpc.add_DecoderServicer_to_server)
            options = ServerOptions(host="localhost", port=0, max_concurrent_rpcs=600)
            started.append((decoder, await start_server(options, [service])))
            await started[-1][1].set_serving()
        yield started
    finally:
        await asyncio.gather(*(running.stop(0) for _, running in started))


async def _eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def _num_serving(channels: CallerChannels) -> int:
    """Replicas the gateway has seen SERVING (where it knows of none, it balances over all)."""
    assert channels.replicas is not None
    return len(channels.replicas.serving)


async def _call(channels: CallerChannels, caller: str) -> None:
    async with channels.stub(caller) as stub:
        await stub.GetModelInfo(decoder_pb2.DecoderGetModelInfoRequest(), timeout=30)


def _gateway_channels(servers: list[RunningServer], max_idle: int = 64) -> CallerChannels:
    address = ",".join(f"127.0.0.1:{running.port}" for running in servers)
    return decoder_channels(GatewayConfig(decoder_address=address, max_idle_channels=max_idle))


def test_replicas_are_a_list_resolved_once_or_a_name_resolved_as_it_goes() -> None:
    assert static_replicas("127.0.0.1:1,localhost:2") == ("127.0.0.1:1", "127.0.0.1:2")
    assert static_replicas(["[::1]:1", "[::1]:2"]) == ("[::1]:1", "[::1]:2")  # type: ignore[arg-type]
    assert static_replicas("dns:///decoder.tandem.svc:50052") is None
    assert name_of("dns:///decoder.tandem.svc:50052") == "decoder.tandem.svc:50052"
    assert name_of("dns://10.0.0.2/decoder:50052") == "decoder:50052"
    assert name_of("decoder:50052") is None


async def test_a_dns_name_is_watched_at_each_address_it_resolves_to(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    (a, server_a), _ = replicas
    assert await resolve_name(f"localhost:{server_a.port}") == (f"127.0.0.1:{server_a.port}",)  # IPv4 first
    config = GatewayConfig(decoder_address=f"dns:///localhost:{server_a.port}")
    channels = decoder_channels(config)
    try:
        assert channels.targets == (config.decoder_address,)  # the name itself, until it resolves
        await _eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        await _call(channels, "peer:1")
        assert a.num_infos == 1
    finally:
        await channels.close()


async def test_callers_go_to_the_serving_replicas_only_and_to_one_that_turns_serving(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    (a, server_a), (b, server_b) = replicas
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)  # loading, or its engine failed
    channels = _gateway_channels([server_a, server_b])
    try:
        await _eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        for caller in range(8):
            for _ in range(2):
                await _call(channels, f"peer:{caller}")
        assert (a.num_infos, b.num_infos) == (16, 0)

        await server_b.set_serving()
        await _eventually(lambda: _num_serving(channels) == 2)
        for caller in range(8):  # each caller's channel over A alone is replaced by one over both
            for _ in range(4):
                await _call(channels, f"peer:{caller}")
        # Round-robin over the replicas READY: a caller's first call may find B still connecting.
        assert a.num_infos + b.num_infos == 48 and b.num_infos >= 8, (a.num_infos, b.num_infos)
    finally:
        await channels.close()


async def test_a_draining_replica_is_left_at_once_and_no_call_fails(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    (a, server_a), (b, server_b) = replicas
    channels = _gateway_channels([server_a, server_b])
    try:
        await _eventually(lambda: _num_serving(channels) == 2)
        await asyncio.gather(*(_call(channels, f"peer:{caller}") for caller in range(8)))
        stopping = asyncio.ensure_future(server_b.stop(30))  # health NOT_SERVING, then GOAWAY
        await _eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        num_b = b.num_infos
        await asyncio.gather(*(_call(channels, f"peer:{caller}") for caller in range(8) for _ in range(2)))
        assert b.num_infos == num_b
        # Nothing of the gateway's holds B's drain: a Watch kept open did, for the whole 30 s.
        await asyncio.wait_for(stopping, 5)
    finally:
        await channels.close()


async def test_an_attacker_holding_its_share_of_watches_leaves_600_gateway_callers_served(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """600 callers, each on a channel of its own (the gateway at --max-connections 512 plus idle
    ones), all from 127.0.0.1, while a caller with no token asks every Watch place (300) of both
    replicas from ::1. Each replica sees the gateway's one Watch; with a Watch on each caller's
    channel, 600 from one address, the 257th caller's calls failed UNAVAILABLE ("health check call
    failed") past the share, and past the attacker's streams without it."""
    attackers = []
    for _, running in replicas:
        attacker = grpc.aio.insecure_channel(f"[::1]:{running.port}")
        attackers.append(attacker)
        stub = health_pb2_grpc.HealthStub(attacker)
        asked = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(300)]
        await asyncio.gather(*(stream.read() for stream in asked), return_exceptions=True)
        assert running.health.num_watches == 256
    channels = _gateway_channels([running for _, running in replicas], max_idle=600)
    try:
        await _eventually(lambda: _num_serving(channels) == 2)
        await asyncio.gather(*(_call(channels, f"peer:{caller}") for caller in range(600)))
        assert channels.num_channels == 600
        assert sum(decoder.num_infos for decoder, _ in replicas) == 600
        for _, running in replicas:
            assert running.health.num_watches_of(f"ipv4:127.0.0.1:{running.port}") == 1
    finally:
        await channels.close()
        await asyncio.gather(*(attacker.close() for attacker in attackers))
