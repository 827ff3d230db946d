"""Health needs no token, so its Watch streams, which never end on their own, hold at most half of
the places a server has for calls (max_concurrent_rpcs), and one address at most 256 of them; one
past either is refused naming the bound: UNIMPLEMENTED while the service watched serves, so that a
client's health checking calls the server unwatched (common/tests/client/test_refused_watch.py),
RESOURCE_EXHAUSTED while it does not. Without the bounds one caller with no token could hold every
place (every Generate, Embed and kubelet Check was then answered RESOURCE_EXHAUSTED). A gateway
watches each decoder once for all its callers (services/gateway/tests/test_replicas.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import open_channel
from tandem.common import health
from tandem.common.health import (
    FAILS_CLOSED,
    FAILS_OPEN,
    MAX_WATCHES_PER_ADDRESS,
    WATCH_PLACE_WAIT_S,
    max_watches,
    watcher_of,
)
from tandem.common.server import RunningServer, ServerOptions, start_server
from tandem.common.watch_refusals import REFUSAL_LOG_INTERVAL_S

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    # Tokens required for every service but health; 8 calls at once in all, health included.
    options = ServerOptions(
        host="127.0.0.1", port=0, auth_tokens=frozenset({"secret"}), max_concurrent_rpcs=8
    )
    running = await start_server(options, [])
    running.health.max_wait_s = 0.05  # a refusal after a short wait, to keep the tests fast
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


async def _refused(
    stub: health_pb2_grpc.HealthStub, code: grpc.StatusCode = grpc.StatusCode.UNIMPLEMENTED, service: str = ""
) -> str:
    """The refusal of a Watch of `service`, which must end `code`."""
    stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == code
    return caught.value.details() or ""


def test_watches_hold_half_of_the_places_a_server_has_for_calls() -> None:
    assert [max_watches(n) for n in (1, 2, 8, 10_000)] == [1, 1, 4, 5_000]


async def test_watches_past_the_bound_leave_the_servers_places_to_its_calls(server: RunningServer) -> None:
    """8 places in all, 4 watches at most: a caller with no token cannot take the places of the calls
    (without the bound the 9th call of any kind was RESOURCE_EXHAUSTED)."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(4)]  # all from one address, within its share
        refusals = [await _refused(stub) for _ in range(6)]
        assert set(refusals) == {
            f"at most 4 health Watch streams at once; {FAILS_OPEN}; Check answers at once"
        }
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


def test_a_watch_counts_against_its_ipv4_address_or_its_ipv6_slash_64() -> None:
    assert watcher_of("ipv4:10.0.0.7:50123") == watcher_of("ipv4:10.0.0.7:41000") == "10.0.0.7"
    assert watcher_of("ipv6:[2001:db8::1]:5000") == watcher_of("ipv6:%5B2001:db8::ffff:1%5D:6000")
    assert watcher_of("ipv6:[2001:db8::1]:5000") == "2001:db8::/64"
    assert watcher_of("ipv6:[2001:db8:0:1::1]:5000") == "2001:db8:0:1::/64"
    assert watcher_of("ipv6:[::ffff:10.0.0.7]:5000") == "10.0.0.7"  # an IPv4 peer of a dual-stack server
    assert watcher_of("unix:/run/tandem.sock") == "unix:/run/tandem.sock"


@pytest.fixture
async def dual_stack_server() -> AsyncIterator[RunningServer]:
    """600 places for calls, 300 for watches; on loopback's 127.0.0.1 and ::1, two addresses."""
    running = await start_server(ServerOptions(host="localhost", port=0, max_concurrent_rpcs=600), [])
    running.health.max_wait_s = 0.05
    await running.set_serving()
    try:
        yield running
    finally:
        await running.stop(0)


async def test_refused_watches_are_logged_at_most_once_an_interval_per_address_with_their_count(
    server: RunningServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's client-side health checking logs no reason for a refusal ("health check call failed",
    "Watch method returned UNIMPLEMENTED"), so without the server's warning an operator could not tell
    that a bound was met, or whose."""
    now = [1_000.0]
    monkeypatch.setattr(health, "time", SimpleNamespace(monotonic=lambda: now[0]))
    caplog.set_level(logging.WARNING, logger="tandem.common.health")

    def warnings() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.name == "tandem.common.health"]

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(4)]
        for _ in range(6):
            await _refused(stub)
        assert warnings() == [
            "1 health Watch stream(s) from 127.0.0.1 refused since the last such warning: at most 4 health "
            "Watch streams at once (while the service serves, a client's balanced channel so refused calls "
            "the server unwatched)"
        ]
        now[0] += REFUSAL_LOG_INTERVAL_S
        await _refused(stub)
        assert len(warnings()) == 2 and warnings()[1].startswith("6 health Watch stream(s) from 127.0.0.1")
        for stream in streams:
            stream.cancel()


async def test_one_address_holds_its_share_of_watches_and_a_balanced_channel_from_another_is_served(
    dual_stack_server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller with no token asks every Watch place (300) from 127.0.0.1: it gets 256, and a balanced
    channel opened after it from ::1 still watches and calls (without the share it was refused)."""
    port = dual_stack_server.port
    assert MAX_WATCHES_PER_ADDRESS == 256
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as attacker:
        stub = health_pb2_grpc.HealthStub(attacker)
        asked = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(300)]
        outcomes = await asyncio.gather(*(stream.read() for stream in asked), return_exceptions=True)
        refusals = {o.details() for o in outcomes if isinstance(o, grpc.aio.AioRpcError)}
        assert sum(not isinstance(o, BaseException) for o in outcomes) == 256
        assert refusals == {
            f"at most 256 health Watch streams at once from one address (127.0.0.1); {FAILS_OPEN}; "
            "Check answers at once"
        }
        logged = [r.getMessage() for r in caplog.records if r.name == "tandem.common.health"]
        assert len(logged) == 1 and "from one address (127.0.0.1)" in logged[0]  # 44 refused, 1 warning
        balanced = open_channel(f"dns:///[::1]:{port}", service="")
        try:
            reply = await health_pb2_grpc.HealthStub(balanced).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert reply.status == SERVING
            assert dual_stack_server.health.num_watches == 257
            assert dual_stack_server.health.num_watches_of(f"ipv6:[::1]:{port}") == 1
        finally:
            await balanced.close()
        for stream in asked:
            stream.cancel()


async def test_a_watch_refused_while_its_service_does_not_serve_is_resource_exhausted(
    server: RunningServer,
) -> None:
    """UNIMPLEMENTED would have a client's health checking call a server that does not serve (a
    replica loading, draining or failed) for as long as its connection lasts; RESOURCE_EXHAUSTED keeps
    the connection out of rotation, as NOT_SERVING would, and its Watch is asked again later."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(4)]
        await server.set_serving(False)
        closed = f"at most 4 health Watch streams at once; {FAILS_CLOSED}; Check answers at once"
        assert await _refused(stub, grpc.StatusCode.RESOURCE_EXHAUSTED) == closed
        assert await _refused(stub, grpc.StatusCode.RESOURCE_EXHAUSTED, service="tandem.v1.Unknown") == closed
        await server.set_serving(True)
        assert (await _refused(stub)).endswith(f"{FAILS_OPEN}; Check answers at once")
        assert await _refused(stub, grpc.StatusCode.RESOURCE_EXHAUSTED, service="tandem.v1.Unknown") == closed
        for stream in streams:
            stream.cancel()


async def _ended(server: RunningServer, num_watches: int) -> None:
    """Waits until the server holds `num_watches` Watch streams."""
    async with asyncio.timeout(5):
        while server.health.num_watches != num_watches:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("bound", ["server", "address"])
async def test_a_watch_at_the_bound_is_served_once_an_old_one_ends_within_the_wait(
    server: RunningServer, bound: str
) -> None:
    """A client that reconnects (its connection aged out, server.py) asks its new Watch before the
    server has ended its old one: at the bound, it was refused and the channel went unwatched for its
    new connection's life. It now waits for the old one's place."""
    server.health.max_wait_s = 2.0
    num_held = 4 if bound == "server" else 2
    server.health.max_watches_per_address = num_held
    assert WATCH_PLACE_WAIT_S == 1.0
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(num_held)]
        reconnected = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
        first = asyncio.ensure_future(reconnected.read())
        async with asyncio.timeout(5):
            while server.health.num_waiting != 1 and not first.done():  # done: refused at once
                await asyncio.sleep(0.01)
        streams.pop(0).cancel()  # the old connection's Watch ends
        assert (await first).status == SERVING
        assert server.health.num_watches == num_held and server.health.num_waiting == 0
        for stream in [*streams, reconnected]:
            stream.cancel()
        await _ended(server, 0)


async def test_a_watch_that_finds_no_place_within_the_wait_is_refused_and_waiters_are_bounded(
    server: RunningServer,
) -> None:
    """The wait holds one of the server's places for calls, so at most max_waiting wait at once (the
    address share here, 2); past them a Watch is refused at once."""
    server.health.max_watches_per_address = 2
    server.health.max_wait_s = 0.5
    assert server.health.max_waiting == 2
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [await _watch(stub) for _ in range(2)]
        waiting = [asyncio.ensure_future(_refused(stub)) for _ in range(2)]
        async with asyncio.timeout(5):
            while server.health.num_waiting != 2:
                await asyncio.sleep(0.01)
        started = asyncio.get_running_loop().time()
        at_once = await _refused(stub)
        assert asyncio.get_running_loop().time() - started < 0.4
        refusals = {at_once, *await asyncio.gather(*waiting)}
        assert refusals == {
            f"at most 2 health Watch streams at once from one address (127.0.0.1); {FAILS_OPEN}; "
            "Check answers at once"
        }
        assert server.health.num_waiting == 0 and server.health.num_watches == 2
        for stream in streams:
            stream.cancel()
        await _ended(server, 0)
