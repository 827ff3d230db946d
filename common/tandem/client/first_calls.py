"""A balanced channel's first calls wait, briefly, until each of its servers has connected or failed.

NOTE: why. gRPC's round_robin picks among the connections that are READY (and, health checked,
SERVING). A fresh channel connects to every server at once but turns READY with the first one, so
every call made before the others connect went to that one: 6 streams started together on a fresh
`DecoderClient("A,B")` went 6/0 (0/6, 6/0, 6/0 in 4 runs), as did a new gateway caller's first
requests, and a stream stays on the replica it started on. So a call that finds its channel IDLE (its
first use, or gRPC's idle timeout dropped its connections) starts a warm-up: the channel is asked to
connect, then each server is asked by a health Check of its own, over a connection of its own, and
the call (with every other call made meanwhile) waits until each Check has answered or failed. The
channel's own connections began first and need no more round trips than a probe (a TCP and HTTP/2
handshake, then one health answer: its Watch where health checked), so by then the servers that
answered are in its rotation and the first burst spreads. That is an ordering, not a promise gRPC
makes: nothing in grpc.aio says which connections round_robin holds, nor which server took a call
(a client call has no peer), hence Checks of slack where health checked and over TLS (NUM_CHECKS_*).

Any answer ends a server's probe: SERVING (it is in the rotation), NOT_SERVING (health checked, a
server loading, draining or failed is never picked: nothing to wait for), an error from a server. A
refused connection fails the probe at once, so it costs no wait; a server that never answers (a
blackhole, a stopped process) holds the calls only until MAX_WAIT_S, or half a call's own timeout
where that is sooner: the call keeps the rest. The probes' connections close with the warm-up. One
server costs nothing: its channel has no gate.

What the gate cannot see, it does not wait for. A `dns:` name's servers are looked up again by the
gate with the system's resolver (getaddrinfo, both families), while the channel uses gRPC's own
(c-ares): where the two differ, the gate waits for the servers it found, and where it finds only one
it does not wait at all. `localhost` is the known case: gRPC's resolver gives ::1 as well as
127.0.0.1 (RFC 6761) where /etc/hosts names only the latter, so the gate adds both loopbacks itself
(one that nothing serves refuses its probe at once). A `dns://resolver/` authority is not followed:
the system's resolver is asked. A probe's failure is logged at DEBUG (a TLS name mismatch shows
there). Nor does it see a Watch: a server that answers Checks at once but its health Watch late (all
its Watch places taken, a new Watch waits up to `tandem.common.health.WATCH_PLACE_WAIT_S`) ends its
probe before it is in rotation, and the first burst leaves it out (6/0 in 10 of 10 fresh channels).
Waiting on the Watch itself would need the channel's own subchannel state, which grpc.aio does not
show; a longer wait would be paid by every fresh channel for a server already at its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import weakref
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

# The longest a call waits for the warm-up: well past a connection on a network (a few ms) and a TLS
# handshake, short against a Generate's time, and what a fresh client pays once where a server is
# unreachable without refusing.
MAX_WAIT_S = 1.0

# Checks per probe, a tuned figure (measured, not derived; a test pins the counts): each Check past the
# first is a round trip of slack for the channel's own connection, begun first but not always in
# rotation first. Unwatched, a connection is in rotation once made, before the probe's first Check is
# answered: 0 of 480 fresh channels one-sided with one (loopback, in-process servers). Watched, it is
# in rotation only once its health Watch is answered, in whatever order the server runs the Watch and
# the probe's Check: with one, 2 of 480 one-sided, with two 0 of 520.
NUM_CHECKS_UNWATCHED = 1
NUM_CHECKS_WATCHED = 2
# Over TLS, one more: the channel's handshake and the probe's race on the same server's threads, and
# a burst still went one-sided in 7 of 80 fresh unwatched channels and 1-3 of 80 watched with the
# counts above; with one more each, 0 of 80 of either. Its cost: one round trip per server per new
# channel, within the warm-up's wait.
NUM_CHECKS_TLS_EXTRA = 1

# Asks one server ("ip:port", "[ip]:port"); returns once it answered or failed, raising nothing.
Probe = Callable[[str], Awaitable[None]]


class FirstCallsGate:
    """Holds a balanced channel's calls while it warms up (see the NOTE): `held` runs on each call's
    details (the channel's last interceptor). `servers`: the channel's servers, each "ip:port"
    ("[ip]:port" for IPv6), or a coroutine that finds them (a `dns:` name); `probe` asks one. `attach`
    the channel once opened."""

    def __init__(
        self, servers: tuple[str, ...] | Callable[[], Awaitable[tuple[str, ...]]], probe: Probe
    ) -> None:
        self._servers = servers
        self._probe = probe
        # Weak: the channel holds its interceptors, they hold the gate; a strong reference back made a
        # cycle, so a channel dropped unclosed lived until the cyclic GC ran. (Its connections still do:
        # grpc.aio's intercepted calls hold them in cycles of their own, with any interceptor.)
        self._channel: weakref.ref[grpc.aio.Channel] | None = None
        self._warm_up: asyncio.Task[None] | None = None  # the one running, or the last one

    def attach(self, channel: grpc.aio.Channel) -> None:
        self._channel = weakref.ref(channel)

    async def held(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        """`details` once the warm-up has ended or the wait's bound has passed, its timeout less the
        wait (gRPC counts a call's timeout from when the interceptors hand it on)."""
        channel = None if self._channel is None else self._channel()
        if channel is None:
            return details
        warm_up = self._warm_up
        if warm_up is None or warm_up.done():
            # IDLE: no connection asked for yet. Checked per call (a C call, no I/O), not once: gRPC's
            # idle timeout drops an unused channel's connections and the next burst starts afresh.
            if channel.get_state() != grpc.ChannelConnectivity.IDLE:
                return details
            warm_up = self._warm_up = asyncio.ensure_future(self._run(channel))
        bound = MAX_WAIT_S if details.timeout is None else min(MAX_WAIT_S, details.timeout / 2)
        start = time.monotonic()
        with contextlib.suppress(TimeoutError):  # shielded: a call that gives up ends no one else's wait
            await asyncio.wait_for(asyncio.shield(warm_up), bound)
        if details.timeout is None:
            return details
        return details._replace(timeout=details.timeout - (time.monotonic() - start))

    async def _run(self, channel: grpc.aio.Channel) -> None:
        channel.get_state(try_to_connect=True)  # before the probes: its connections start first
        try:
            servers = self._servers if isinstance(self._servers, tuple) else await self._servers()
            if len(servers) > 1:
                await asyncio.wait_for(asyncio.gather(*(self._probe(s) for s in servers)), MAX_WAIT_S)
        except Exception as error:  # noqa: BLE001 past the bound, a name not resolving: the calls go on
            log.debug("balanced channel warm-up ended: %r", error)


def num_checks(is_watched: bool, is_tls: bool) -> int:
    """The health Checks one probe makes (see NUM_CHECKS_WATCHED)."""
    num = NUM_CHECKS_WATCHED if is_watched else NUM_CHECKS_UNWATCHED
    return num + NUM_CHECKS_TLS_EXTRA if is_tls else num


def health_probe(
    open_probe_channel: Callable[[str], grpc.aio.Channel], service: str | None, is_tls: bool = False
) -> Probe:
    """A probe by health Checks over a channel of its own to the server, opened by
    `open_probe_channel` retrying nothing: a refused connection fails the Check at once. `service`:
    the health service the balanced channel watches; None, it watches none (Checked: the server's).
    `is_tls`: the channel uses TLS (one Check more)."""
    num = num_checks(service is not None, is_tls)
    request = health_pb2.HealthCheckRequest(service=service or "")

    async def probe(server: str) -> None:
        channel = open_probe_channel(server)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(num):
                await stub.Check(request, timeout=MAX_WAIT_S)
        except grpc.aio.AioRpcError as error:
            # Failed, or answered with an error: either way this server's probe has ended (and the
            # gate waits no more for it). Said, as a TLS name mismatch ends every probe alike.
            log.debug("warm-up probe of %s failed: %s %s", server, error.code().name, error.details())
        finally:
            await channel.close()

    return probe


def name_resolver(host: str, port: int) -> Callable[[], Awaitable[tuple[str, ...]]]:
    """The servers a `dns:` name names now, as near as the system's resolver tells what gRPC's finds
    (both families; see the NOTE): `localhost` and a `.localhost` name are both loopbacks, as RFC 6761
    has resolvers answer and gRPC's does, whatever /etc/hosts says."""

    async def servers() -> tuple[str, ...]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM
        )
        found = dict.fromkeys(
            f"{sockaddr[0]}:{port}" if family == socket.AF_INET else f"[{sockaddr[0]}]:{port}"
            for family, *_, sockaddr in infos
        )
        if host.lower().rstrip(".") == "localhost" or host.lower().rstrip(".").endswith(".localhost"):
            found.update(dict.fromkeys((f"127.0.0.1:{port}", f"[::1]:{port}")))
        return tuple(found)

    return servers
