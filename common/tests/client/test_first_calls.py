"""A balanced channel's first calls wait until each server has connected or failed
(`tandem.client.first_calls`): the first burst of a fresh channel spreads over every replica, a
refused server costs it nothing, and one that never answers holds it at most the bound."""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import socket
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tests.client.pem_files import localhost_pki
from common.tests.client.replica import Replica, serve_decoder
from common.tests.ports import free_port
from tandem.client.channel import open_channel
from tandem.client.first_calls import FirstCallsGate, health_probe, num_checks
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.client.security import ChannelSecurity
from tandem.common.server import RunningServer, ServerOptions, Service, TlsOptions, start_server


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
    """A loopback port nothing listens on: a connection to it is refused at once. Of this worker's slice,
    below the ephemeral range, where no connection or server of another worker lands meanwhile."""
    return f"127.0.0.1:{free_port()}"


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


# What the gate's timing tests promise is a wait's length against a bound: none for a refused server,
# the bound for a silent one, half a call's timeout where that is less. Each sets the bound (MAX_WAIT_S)
# far from what the right wait takes, so the wall clock, which a loaded host stretches (two workers on
# two cores), decides nothing within seconds: a wait of the wrong length is tens of seconds off.
LONG_WAIT_S = 30.0  # a bound no right wait comes near
CALL_TIMEOUT_S = 2 * LONG_WAIT_S  # so half a call's timeout is no nearer


async def test_a_refused_server_costs_the_first_call_no_wait(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal ends its probe at once: the burst is not held until the bound (1 s, here 30 s)."""
    monkeypatch.setattr("tandem.client.first_calls.MAX_WAIT_S", LONG_WAIT_S)
    channel = open_channel([servers[0].address, _refused_address()], service="tandem.v1.Decoder")
    try:
        start = time.monotonic()
        assert await _first_burst(channel, 2, timeout=CALL_TIMEOUT_S) == ["a", "a"]
        assert time.monotonic() - start < LONG_WAIT_S / 3  # milliseconds idle
    finally:
        await channel.close()


async def test_a_server_that_never_answers_holds_the_first_call_only_until_the_bound(
    servers: list[RunningServer], silent_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held the bound (0.5 s here) and no longer: not until half the call's timeout (30 s), nor a
    second time for the next burst (the bound is then 30 s: a second warm-up would hold it that long)."""
    monkeypatch.setattr("tandem.client.first_calls.MAX_WAIT_S", 0.5)
    channel = open_channel([servers[0].address, silent_address], service="tandem.v1.Decoder")
    try:
        start = time.monotonic()
        assert await _first_burst(channel, 2, timeout=CALL_TIMEOUT_S) == ["a", "a"]
        assert 0.45 < time.monotonic() - start < LONG_WAIT_S / 3  # ~0.5 s idle; a late host only adds
        monkeypatch.setattr("tandem.client.first_calls.MAX_WAIT_S", LONG_WAIT_S)
        start = time.monotonic()
        # One warm-up per connecting, not per call: the channel is not IDLE now.
        assert await _first_burst(channel, 2, timeout=CALL_TIMEOUT_S) == ["a", "a"]
        assert time.monotonic() - start < LONG_WAIT_S / 3
    finally:
        await channel.close()


async def test_a_call_keeps_half_its_timeout_however_long_the_warm_up(
    servers: list[RunningServer], silent_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call's timeout is not spent on the wait: at most half of it, the call keeping the rest. Held
    1.5 s of a 3 s timeout where the bound is 30 s, its Generate still has 1.5 s: it answers."""
    monkeypatch.setattr("tandem.client.first_calls.MAX_WAIT_S", LONG_WAIT_S)
    channel = open_channel([servers[0].address, silent_address], service="tandem.v1.Decoder")
    try:
        start = time.monotonic()
        assert await _first_burst(channel, 1, timeout=3.0) == ["a"]  # held 1.5 s, not the bound's 30 s
        assert time.monotonic() - start > 1.45  # it did wait: half, not nothing
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


async def _serve_on_both_loopbacks(tls: TlsOptions | None = None) -> list[RunningServer]:
    """Replica "v4" on 127.0.0.1 and "v6" on [::1], on one port: the two servers `localhost` names.
    Skips where this host has no IPv6 loopback."""
    for _ in range(20):  # the port free on 127.0.0.1 may be taken on ::1
        v4 = await start_server(ServerOptions(host="127.0.0.1", tls=tls), [_decoder(Replica("v4"))])
        try:
            v6 = await start_server(
                ServerOptions(host="::1", port=v4.port, tls=tls), [_decoder(Replica("v6"))]
            )
        except Exception:  # noqa: BLE001 taken, or no IPv6 loopback: tried again, then skipped
            await v4.stop(0)
            continue
        await v4.set_serving()
        await v6.set_serving()
        return [v4, v6]
    pytest.skip("no port free on both loopbacks (or no IPv6 loopback)")


def _decoder(replica: Replica) -> Service:
    return Service("tandem.v1.Decoder", replica, decoder_pb2_grpc.add_DecoderServicer_to_server)


@pytest.mark.parametrize("is_health_checked", [True, False], ids=["watched", "unwatched"])
async def test_a_dns_names_first_burst_reaches_every_server_it_resolves_to(is_health_checked: bool) -> None:
    """`dns:///localhost:port` is 127.0.0.1 and ::1 to gRPC's resolver; the gate's own lookup
    (getaddrinfo) gave 127.0.0.1 alone where /etc/hosts names no ::1, saw one server, and did not wait:
    one-sided in 20 of 20 fresh channels."""
    servers = await _serve_on_both_loopbacks()
    try:
        for _ in range(3):
            channel = open_channel(
                f"dns:///localhost:{servers[0].port}",
                service="tandem.v1.Decoder",
                own_connection=True,
                is_health_checked=is_health_checked,
            )
            try:
                assert collections.Counter(await _first_burst(channel, 6)) == {"v4": 3, "v6": 3}
            finally:
                await channel.close()
    finally:
        await asyncio.gather(*(server.stop(0) for server in servers))


async def test_a_tls_dns_names_probes_go_by_the_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each probe dials one of the name's addresses; going by that address, it failed the servers'
    certificate check (they name `localhost`), and the gate stopped waiting at once. It goes by the
    name, as the channel does: no probe fails, and the burst spreads. The bound is LONG_WAIT_S: at 1 s
    two TLS handshakes on a loaded host outran it once in a clean-clone run (all 6 calls to one)."""
    monkeypatch.setattr("tandem.client.first_calls.MAX_WAIT_S", LONG_WAIT_S)
    ca, cert_file, key_file = localhost_pki(tmp_path)
    servers = await _serve_on_both_loopbacks(TlsOptions(cert_file=cert_file, key_file=key_file))
    caplog.set_level(logging.DEBUG, logger="tandem.client.first_calls")
    try:
        for _ in range(3):
            channel = open_channel(
                f"dns:///localhost:{servers[0].port}",
                security=ChannelSecurity(root_certificates=ca),
                service="tandem.v1.Decoder",
                own_connection=True,
            )
            try:
                assert collections.Counter(await _first_burst(channel, 6)) == {"v4": 3, "v6": 3}
            finally:
                await channel.close()
        assert not [r.getMessage() for r in caplog.records if "probe" in r.getMessage()]
    finally:
        await asyncio.gather(*(server.stop(0) for server in servers))


async def test_a_failed_probe_is_logged_at_debug(
    servers: list[RunningServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A probe's failure ends its wait silently otherwise: a TLS name mismatch looked like no server."""
    caplog.set_level(logging.DEBUG, logger="tandem.client.first_calls")
    refused = _refused_address()
    channel = open_channel([servers[0].address, refused], service="tandem.v1.Decoder")
    try:
        await _first_burst(channel, 1)
    finally:
        await channel.close()
    probed = [r for r in caplog.records if r.getMessage().startswith("warm-up probe")]
    assert [(r.levelno, r.getMessage().partition(" failed: ")[0]) for r in probed] == [
        (logging.DEBUG, f"warm-up probe of {refused}")
    ]
    assert probed[0].getMessage().partition(" failed: ")[2].startswith("UNAVAILABLE ")


class _FakeChannel:
    """A channel's connectivity state, as the gate reads it, set by the test."""

    def __init__(self) -> None:
        self.state = grpc.ChannelConnectivity.IDLE

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        if try_to_connect and self.state == grpc.ChannelConnectivity.IDLE:
            self.state = grpc.ChannelConnectivity.CONNECTING
        return self.state


class _HeldProbe:
    """Records each server probed; a probe ends when `release` is set."""

    def __init__(self) -> None:
        self.probed: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, server: str) -> None:
        self.probed.append(server)
        await self.release.wait()


def _details(timeout: float | None = None) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails("/tandem.v1.Decoder/Generate", timeout, None, None, None)


async def test_a_channel_idle_again_warms_up_again() -> None:
    """gRPC's idle timeout drops an unused channel's connections; its next burst would go to the
    first server to reconnect, so a call finding the channel IDLE again starts a new warm-up, and one
    finding it connected starts none."""
    probe = _HeldProbe()
    probe.release.set()
    channel = _FakeChannel()
    gate = FirstCallsGate(("a:1", "b:2"), probe)
    gate.attach(channel)  # type: ignore[arg-type]
    await gate.held(_details())
    assert probe.probed == ["a:1", "b:2"]
    channel.state = grpc.ChannelConnectivity.READY
    await gate.held(_details())
    assert probe.probed == ["a:1", "b:2"]
    channel.state = grpc.ChannelConnectivity.IDLE
    await gate.held(_details())
    assert probe.probed == ["a:1", "b:2", "a:1", "b:2"]


async def test_a_call_cancelled_while_held_ends_no_other_calls_wait() -> None:
    """The calls held share one warm-up; one cancelled (its caller gone) leaves it running for the
    others, who still wait for it, once."""
    probe = _HeldProbe()
    channel = _FakeChannel()  # held here: the gate's reference to it is weak
    gate = FirstCallsGate(("a:1", "b:2"), probe)
    gate.attach(channel)  # type: ignore[arg-type]
    cancelled, waiting = (asyncio.ensure_future(gate.held(_details())) for _ in range(2))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    await asyncio.sleep(0.05)
    assert cancelled.cancelled() and not waiting.done()
    probe.release.set()
    assert (await asyncio.wait_for(waiting, 1)).method == "/tandem.v1.Decoder/Generate"
    assert probe.probed == ["a:1", "b:2"]
