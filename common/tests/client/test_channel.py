"""A balanced channel that watches no health (`is_health_checked=False`, the gateway's per-caller
channels) still gets its Generate calls served while a replica answers UNAVAILABLE before taking the
call (as a loading, draining or failed decoder does) or stops: gRPC retries a Generate no server
began on the next replica, and round_robin skips a replica it cannot connect to."""

from __future__ import annotations

import asyncio
import collections
import json

import grpc
import pytest

from common.tests.client.replica import Replica, serve_decoder
from tandem.client.channel import KEEPALIVE_MS, REPLICA_KEEPALIVE_MS, open_channel, service_config
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc


async def _served_by(channel: grpc.aio.Channel, num_calls: int) -> collections.Counter[str]:
    stub = decoder_pb2_grpc.DecoderStub(channel)

    async def one() -> str:
        stream = stub.Generate(decoder_pb2.GenerateRequest(), timeout=10)
        return (await stream.read()).request_id

    return collections.Counter([await one() for _ in range(num_calls)])


def test_a_balanced_channel_watches_health_unless_told_not_to() -> None:
    watched = json.loads(service_config(is_balanced=True, health_service="tandem.v1.Decoder"))
    unwatched = json.loads(service_config(is_balanced=True))
    assert watched["healthCheckConfig"] == {"serviceName": "tandem.v1.Decoder"}
    assert unwatched["loadBalancingConfig"] == watched["loadBalancingConfig"] == [{"round_robin": {}}]
    assert "healthCheckConfig" not in unwatched


async def test_a_replica_s_channel_takes_the_options_of_an_unwatched_channel_over_several(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway's channel to one replica it watches (`is_replica`) gets what a channel over several
    gets, the replicas' keepalive and round_robin, where one address otherwise gets one server's."""
    options_of: dict[str, list[tuple[str, object]]] = {}
    insecure_channel = grpc.aio.insecure_channel

    def recorded(target: str, options: list[tuple[str, object]], interceptors: object) -> grpc.aio.Channel:
        options_of.setdefault(target, options)  # the balanced channel's, before its probes'
        return insecure_channel(target, options=options, interceptors=interceptors)

    monkeypatch.setattr(grpc.aio, "insecure_channel", recorded)
    channels = [
        open_channel("127.0.0.1:1,127.0.0.1:2", service="tandem.v1.Decoder", is_health_checked=False),
        open_channel("127.0.0.1:3", service="tandem.v1.Decoder", is_replica=True),
        open_channel("127.0.0.1:4", service="tandem.v1.Decoder"),
    ]
    try:
        assert options_of["127.0.0.1:3"] == options_of["ipv4:127.0.0.1:1,127.0.0.1:2"]
        assert ("grpc.keepalive_time_ms", REPLICA_KEEPALIVE_MS[0]) in options_of["127.0.0.1:3"]
        assert ("grpc.keepalive_time_ms", KEEPALIVE_MS[0]) in options_of["127.0.0.1:4"]
    finally:
        for channel in channels:
            await channel.close()


async def test_an_unwatched_balanced_channel_retries_a_refused_generate_and_skips_a_stopped_replica() -> None:
    replicas = [Replica("a"), Replica("b")]
    servers = [await serve_decoder(replica) for replica in replicas]
    channel = open_channel(
        [s.address for s in servers],
        service="tandem.v1.Decoder",
        own_connection=True,
        is_health_checked=False,
    )
    try:
        assert set(await _served_by(channel, 8)) == {"a", "b"}  # round-robin over both
        replicas[1].is_loading = True
        assert await _served_by(channel, 8) == {"a": 8}  # each refusal retried on the other
        assert replicas[1].num_refused >= 3
        replicas[1].is_loading = False
        await servers[1].stop(0)  # its connection and listener closed, as a killed or drained one's
        assert await _served_by(channel, 8) == {"a": 8}
    finally:
        await channel.close()
        await asyncio.gather(*(s.stop(0) for s in servers))


class FreezableProxy:
    """A TCP proxy in front of a server that, once `frozen`, forwards nothing more either way: a
    server process stopped (SIGSTOP, a frozen VM), whose host's kernel still holds its connections
    open and accepts new ones."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.running = asyncio.Event()
        self.running.set()
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self.running.set()
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.running.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


async def test_a_stopped_replica_is_left_within_its_keepalive_not_gRPCs_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica stopped leaves its connection and its health Watch open and says nothing: the
    channel's round_robin kept sending it half of all new calls, each hung to its deadline, for 58 s
    (gRPC's flow-control ping, in flight, held off every keepalive ping until its own 1 minute
    timeout). Over several servers a ping every 2 s unanswered in 3 s closes its connection; here
    0.2 s and 0.3 s, and a Generate it never answered is retried on the other."""
    monkeypatch.setattr("tandem.client.channel.REPLICA_KEEPALIVE_MS", (200, 300))
    replicas = [Replica("a"), Replica("b")]
    servers = [await serve_decoder(replica) for replica in replicas]
    proxy = FreezableProxy(servers[1].address)
    await proxy.start()
    channel = open_channel(
        [servers[0].address, proxy.address], service="tandem.v1.Decoder", own_connection=True
    )
    try:
        assert set(await _served_by(channel, 8)) == {"a", "b"}
        proxy.running.clear()  # SIGSTOP
        stub = decoder_pb2_grpc.DecoderStub(channel)
        async with asyncio.timeout(3):  # hung to the 10 s deadline before
            served = [
                (await stub.Generate(decoder_pb2.GenerateRequest(), timeout=10).read()) for _ in range(8)
            ]
        assert {reply.request_id for reply in served} == {"a"}
    finally:
        await channel.close()
        await proxy.close()
        await asyncio.gather(*(server.stop(0) for server in servers))
