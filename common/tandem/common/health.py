"""grpc.health.v1 with its Watch streams bounded: the one service every caller reaches unauthenticated.

NOTE: why Watch is bounded, and how far. Health needs no token (kubelets and load balancers probe it),
and a Watch stream never ends on its own, so any caller could hold as many as it liked, each a call
the server counts against its `max_concurrent_rpcs` (server.py): 10,000 of them answered every
Generate, Embed and kubelet Check RESOURCE_EXHAUSTED. At most half of those places hold Watch streams,
and one address at most MAX_WATCHES_PER_ADDRESS of them, so a caller with no token holding all it can
from one address leaves the other places to every other client's channels. A balanced client channel
watches each server once, and a process's channels with the same options share one connection and
one Watch; the gateway watches each decoder once for all its callers (`tandem.gateway.replicas`),
whose own channels do not watch, so neither comes near the share. Whoever is behind one address shares
its count: a NAT's or a proxy's clients, a mesh's (Istio's sidecar sends from 127.0.0.6), and an IPv6
caller's whole /64, which a host, or a Kubernetes node and all its pods, commonly holds. Check is
unbounded: it answers at once.

NOTE: why a refused Watch is UNIMPLEMENTED while its service serves, and so fails open. gRPC's
client-side health checking (a balanced channel's healthCheckConfig) takes a Watch that ends with any
other status as "not serving" and asks again with backoff (1 s growing to 120 s), so the connection
got no calls: whoever held the 256 places of an address (or 20 addresses' worth, all 5,000) failed
every balanced channel opened after it from there, "health check call failed", with no token.
UNIMPLEMENTED is gRFC A17's "this server does not watch": gRPC core (health_check_client.cc), grpc-go,
grpc-java and our Node client (clients/node/health.js) then call the server unwatched, and log an
error. The refused channel loses health-based routing on that connection until it reconnects: a
draining server it still leaves as the connection closes, but a server that answers UNAVAILABLE before
taking a call (a loading decoder; a one-process decoder whose engine failed stays up NOT_SERVING) gets
its share of first attempts, each retried on the next server until the channel's retry throttling
stops retries (11 refusals back to back; then about half its calls failed). So a Watch refused while
its service does not serve (a replica loading, draining, failed; a service it does not know) is
RESOURCE_EXHAUSTED: the connection stays out of rotation, where NOT_SERVING would have put it, and
asks again with backoff, to be answered UNIMPLEMENTED once the service serves. A direct Watch caller
(grpcurl; the gateway's watch, which turns to Check) sees either status with the bound in its message.
A refusal is logged (at most once a minute per address, `watch_refusals.py`), as the refused client's
gRPC keeps its reason to itself.

NOTE: why a Watch at a bound waits a moment before it is refused. A server asks each connection to go
after max_connection_age_s (server.py), and its client's new Watch, on the new connection, reaches the
server before the server has ended the old connection's: at its address's bound, every such Watch was
refused, and that channel went unwatched for its next connection's life (N channels, a bound of N, 1 s
ages: 1 of them refused in 10 s; 16 clients at 0.5 s: 7 to 9). So a Watch that finds no place waits up
to WATCH_PLACE_WAIT_S for one to be given back, and is refused only then. A waiting Watch holds one of
the server's places for calls, so at most `max_waiting` wait at once (the address share or the Watch
bound, the smaller); one more is refused at once, as before.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from tandem.common.watch_refusals import WatchRefusals

# Watch streams one address holds at once: 256 client processes' balanced channels, each watching a
# server once (channels of one process with the same options share one connection and one Watch).
MAX_WATCHES_PER_ADDRESS = 256
# How long a Watch that finds its bound met waits for a place before it is refused: a reconnected
# client's old Watch ends within a round trip or two of its new one arriving (the module's note).
WATCH_PLACE_WAIT_S = 1.0
# What a refused Watch's caller is told beside the bound, as its service serves or does not.
FAILS_OPEN = "refused UNIMPLEMENTED, so that client-side health checking calls the server unwatched"
FAILS_CLOSED = "refused RESOURCE_EXHAUSTED while the service does not serve (UNIMPLEMENTED once it does)"

log = logging.getLogger(__name__)


def max_watches(max_concurrent_rpcs: int) -> int:
    """Watch streams a server with this bound on its calls holds at once: half, at least one."""
    return max(1, max_concurrent_rpcs // 2)


def watcher_of(peer: str) -> str:
    """Whose share a Watch from `peer` (gRPC's "ipv4:1.2.3.4:5678", "ipv6:[::1]:5678") counts against:
    an IPv4 address, an IPv6 address's /64 (an IPv4-mapped one is its IPv4 address), else the peer."""
    scheme, _, rest = unquote(peer).partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    host = rest.rpartition(":")[0].strip("[]").partition("%")[0]  # less the port and any zone
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return peer
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class BoundedHealth(HealthServicer):
    """grpc_health's servicer, less a Watch past `max_watches` at once or past
    `max_watches_per_address` from one address (`watcher_of`)."""

    def __init__(
        self,
        max_watches: int,
        max_watches_per_address: int = MAX_WATCHES_PER_ADDRESS,
        max_wait_s: float = WATCH_PLACE_WAIT_S,
    ) -> None:
        super().__init__()
        self.max_watches = max_watches
        self.max_watches_per_address = max_watches_per_address
        self.max_wait_s = max_wait_s  # a Watch at a bound waits this long for a place
        self.num_watches = 0
        self.num_waiting = 0  # Watch calls waiting for a place, at most max_waiting
        # Set, and replaced by a fresh one, each time a Watch ends and gives its place back.
        self._watch_ended = asyncio.Event()
        self._num_watches_of: Counter[str] = Counter()  # open Watch streams, by watcher_of
        # gRPC's client-side health checking logs no reason on the client ("Watch method returned
        # UNIMPLEMENTED", "health check call failed"), so the server's log is where an operator sees a
        # bound met, and whose.
        self.refusals = WatchRefusals(log)

    def num_watches_of(self, peer: str) -> int:
        """Watch streams open from `peer`'s address (its share, `watcher_of`)."""
        return self._num_watches_of[watcher_of(peer)]

    @property
    def max_waiting(self) -> int:
        """Watch calls that wait for a place at once; one more is refused at once."""
        return min(self.max_watches, self.max_watches_per_address)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watcher = watcher_of(context.peer())
        bound = self._bound_met(watcher)
        if bound is not None:
            bound = await self._wait_for_place(watcher)
        if bound is not None:
            await self._refuse(context, watcher, bound, request.service)
        # No await since _bound_met found a place, so no other Watch has taken it.
        self.num_watches += 1
        self._num_watches_of[watcher] += 1
        try:
            await super().Watch(request, context)
        finally:
            self.num_watches -= 1
            self._num_watches_of[watcher] -= 1
            if not self._num_watches_of[watcher]:
                del self._num_watches_of[watcher]
            self._watch_ended.set()
            self._watch_ended = asyncio.Event()

    def _bound_met(self, watcher: str) -> str | None:
        """The bound a Watch from `watcher` would pass, if any."""
        if self.num_watches >= self.max_watches:
            return f"at most {self.max_watches} health Watch streams at once"
        if self._num_watches_of[watcher] >= self.max_watches_per_address:
            bound = f"at most {self.max_watches_per_address} health Watch streams at once from one address"
            return f"{bound} ({watcher})"
        return None

    async def _wait_for_place(self, watcher: str) -> str | None:
        """Waits up to max_wait_s for a Watch to end and leave `watcher` a place (the module's note);
        the bound still met then, or at once where max_waiting already wait."""
        if self.num_waiting < self.max_waiting:
            self.num_waiting += 1
            try:
                async with asyncio.timeout(self.max_wait_s):
                    while self._bound_met(watcher) is not None:
                        await self._watch_ended.wait()
            except TimeoutError:
                pass
            finally:
                self.num_waiting -= 1
        return self._bound_met(watcher)

    async def _refuse(
        self, context: grpc.aio.ServicerContext, watcher: str, bound: str, service: str
    ) -> None:
        """Ends the Watch naming `bound`: UNIMPLEMENTED while `service` serves, else RESOURCE_EXHAUSTED
        (the module's note); logged at most once an interval per watcher (`WatchRefusals`)."""
        self.refusals.refused(watcher, bound, time.monotonic())
        # grpc_health's own record of each service's status, the one Check and Watch answer from.
        if self._server_status.get(service) == health_pb2.HealthCheckResponse.SERVING:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"{bound}; {FAILS_OPEN}; Check answers at once"
            )
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"{bound}; {FAILS_CLOSED}; Check answers at once"
        )
