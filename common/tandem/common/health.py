"""grpc.health.v1 with its Watch streams bounded: the one service every caller reaches unauthenticated.

NOTE: why Watch is bounded, and how far. Health needs no token (kubelets and load balancers probe it),
and a Watch stream never ends on its own, so any caller could hold as many as it liked, each a call
the server counts against its `max_concurrent_rpcs` (server.py): 10,000 of them answered every
Generate, Embed and kubelet Check RESOURCE_EXHAUSTED. At most half of those places hold Watch streams,
and one address at most MAX_WATCHES_PER_ADDRESS of them (one past either: RESOURCE_EXHAUSTED naming
the bound), so a caller with no token holding all it can from one address leaves the other places to
every other client's channels, which watch before they call. A balanced client channel watches each
server once; the gateway watches each decoder once for all its callers (`tandem.gateway.replicas`),
whose own channels do not watch, so neither comes near the share. An IPv6 caller is counted by its
/64, which one host commonly holds whole. Check is unbounded: it answers at once.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

# Watch streams one address holds at once: 256 balanced client channels, each watching a server once.
MAX_WATCHES_PER_ADDRESS = 256


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

    def __init__(self, max_watches: int, max_watches_per_address: int = MAX_WATCHES_PER_ADDRESS) -> None:
        super().__init__()
        self.max_watches = max_watches
        self.max_watches_per_address = max_watches_per_address
        self.num_watches = 0
        self._num_watches_of: Counter[str] = Counter()  # open Watch streams, by watcher_of

    def num_watches_of(self, peer: str) -> int:
        """Watch streams open from `peer`'s address (its share, `watcher_of`)."""
        return self._num_watches_of[watcher_of(peer)]

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watcher = watcher_of(context.peer())
        if self.num_watches >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_watches} health Watch streams at once; Check answers at once",
            )
        if self._num_watches_of[watcher] >= self.max_watches_per_address:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_watches_per_address} health Watch streams at once from one address "
                f"({watcher}); Check answers at once",
            )
        self.num_watches += 1
        self._num_watches_of[watcher] += 1
        try:
            await super().Watch(request, context)
        finally:
            self.num_watches -= 1
            self._num_watches_of[watcher] -= 1
            if not self._num_watches_of[watcher]:
                del self._num_watches_of[watcher]
