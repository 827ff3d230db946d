"""A balanced channel's first calls wait until each server has connected or failed
(`tandem.client.first_calls`): the first burst of a fresh channel spreads over every replica, a
refused server costs it nothing, and one that never answers holds it at most the bound."""

from __future__ import annotations

import asyncio
import collections
import gc
import socket
import time
import weakref
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tests.client.replica import Replica, serve_decoder
from tandem.client.channel import open_channel
from tandem.client.first_calls import health_probe, num_checks
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.common.server import RunningServer


async def _first_burst(channel: grpc.aio.Channel, num_calls: int, timeout: float = 10) -> list[str]:
    """The replica that took each of `num_calls` Generate streams started together."""
    stub = decoder_pb2_grpc.DecoderStub(channel)

    async def one() -> str:
        return (await stub.Generate(decoder_pb2.GenerateRequest(), timeout=timeout).read()).request_id

    return await asyncio.gather(*(one() for _ in range(num_calls)))


@pytest.fixture
async def servers() -> AsyncIterator[list[RunningServer]]:
    started = [await serve_decoder(Replica(name)) for name in "ab"]
    yield started
    await asyncio.gather(*(server.stop(0) for server in started))


def _refused_address() -> str:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{free.getsockname()[1]}"


@pytest.fixture
def silent_address() -> AsyncIterator[str]:
    """A port whose kernel accepts connections for a server that never says a word (a process stopped,
    a host gone behind a proxy): a channel to it stays CONNECTING."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.mark.parametrize(
    ("is_health_checked", "own_connection"),
    [(True, True), (False, True), (True, False)],
    ids=["watched (DecoderClient)", "unwatched, own connections (a gateway caller)", "watched, shared"],
)
async def test_a_fresh_channels_first_burst_reaches_every_replica(
    servers: list[RunningServer], is_health_checked: bool, own_connection: bool
) -> None:
    """round_robin picks only connected replicas; a channel is READY with its first, so a burst made
    at once all went there (6/0 in 4 of 5 fresh channels here). Each fresh channel's burst now spreads."""
    for _ in range(3):
        channel = open_channel(
            [server.address for server in servers],
            service="tandem.v1.Decoder",
            own_connection=own_connection,
            is_health_checked=is_health_checked,
        )
        try:
            assert collections.Counter(await _first_burst(channel, 6)) == {"a": 3, "b": 3}
        finally:
            await channel.close()


async def test_a_refused_server_costs_the_first_call_no_wait(servers: list[RunningServer]) -> None:
    channel = open_channel([servers[0].address, _refused_address()], service="tandem.v1.Decoder")
    try:
        start = time.monotonic()
        assert await _first_burst(channel, 2) == ["a", "a"]
        assert time.monotonic() - start < 0.5  # the bound is 1 s; a refusal ends its probe at once
    finally:
        await channel.close()


async def test_a_server_that_never_answers_holds_the_first_call_only_until_the_bound(
    servers: list[RunningServer], silent_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tandem.client.first_calls.MAX_WAIT_S", 0.3)
    channel = open_channel([servers[0].address, silent_address], service="tandem.v1.Decoder")
    try:
        start = time.monotonic()
        assert await _first_burst(channel, 2) == ["a", "a"]
        assert 0.25 < time.monotonic() - start < 1.0
        start = time.monotonic()
        assert await _first_burst(channel, 2) == ["a", "a"]  # one warm-up per connecting, not per call
        assert time.monotonic() - start < 0.25
    finally:
        await channel.close()


async def test_a_call_keeps_half_its_timeout_however_long_the_warm_up(
    servers: list[RunningServer], silent_address: str
) -> None:
    """A call's timeout is not spent on the wait: at most half of it, the call keeping the rest."""
    channel = open_channel([servers[0].address, silent_address], service="tandem.v1.Decoder")
    try:
        start = time.monotonic()
        assert await _first_burst(channel, 1, timeout=0.4) == ["a"]  # held 0.2 s, not the bound's 1 s
        assert time.monotonic() - start < 0.35
    finally:
        await channel.close()


class _CountingHealth(health_pb2_grpc.HealthServicer):
    """Answers every Check SERVING and counts them."""

    def __init__(self) -> None:
        self.num_checks = 0

    async def Check(self, request, context):  # type: ignore[no-untyped-def]
        self.num_checks += 1
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.parametrize(
    ("service", "is_tls", "expected"),
    [(None, False, 1), ("tandem.v1.Decoder", False, 2), (None, True, 2), ("tandem.v1.Decoder", True, 3)],
    ids=["unwatched", "watched", "unwatched over TLS", "watched over TLS"],
)
async def test_a_probe_checks_as_often_as_its_kind_needs(
    service: str | None, is_tls: bool, expected: int
) -> None:
    """The counts are a tuned figure (first_calls.NUM_CHECKS_*): a Check past the first is a round trip
    of slack, one where the channel watches health, one more over TLS (its handshake is slower)."""
    health = _CountingHealth()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        # The probe's own channel is plaintext here: the count, not the handshake, is under test.
        await health_probe(grpc.aio.insecure_channel, service, is_tls)(f"127.0.0.1:{port}")
        assert health.num_checks == expected == num_checks(service is not None, is_tls)
    finally:
        await server.stop(0)


async def test_a_dropped_channel_is_freed_without_the_cyclic_gc(servers: list[RunningServer]) -> None:
    """The gate refers to its channel weakly: a strong reference (channel -> interceptors -> gate ->
    channel) kept a channel dropped unclosed until the cyclic GC ran."""
    channel = open_channel([server.address for server in servers], service="tandem.v1.Decoder")
    await _first_burst(channel, 2)
    dropped = weakref.ref(channel)
    gc.disable()
    try:
        del channel
        assert dropped() is None
    finally:
        gc.enable()
