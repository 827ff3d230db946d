"""grpc.health.v1 with its Watch streams bounded: the one service every caller reaches unauthenticated.

NOTE: why Watch is bounded. Health needs no token (kubelets and load balancers probe it), and a Watch
stream never ends on its own, so any caller could hold as many as it liked: each a call the server
counts against `max_concurrent_rpcs` (server.py), so 10,000 of them answered every Generate, Embed
and kubelet Check RESOURCE_EXHAUSTED, and without that bound each held ~20 KB for as long as it
pleased. At most MAX_WATCHES run at once, at most MAX_WATCHES_PER_PEER from one address; one past
either is RESOURCE_EXHAUSTED naming the bound. Check is unbounded: it answers at once. A balanced
client channel watches each server once (`tandem.client.channel`'s healthCheckConfig), so a fleet of
gateways and clients stays far below either bound.
"""

from __future__ import annotations

import collections

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

MAX_WATCHES = 1024  # Watch streams at once, all callers together: a tenth of max_concurrent_rpcs
MAX_WATCHES_PER_PEER = 256  # of those, from one address (a gateway's balanced channels, one a caller)


class BoundedHealth(HealthServicer):
    """grpc_health's servicer, less a Watch past MAX_WATCHES or MAX_WATCHES_PER_PEER."""

    def __init__(self) -> None:
        super().__init__()
        self.num_watches = 0
        self._by_peer: collections.Counter[str] = collections.Counter()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        peer = _address(context.peer())
        if self.num_watches >= MAX_WATCHES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {MAX_WATCHES} health Watch streams at once; Check answers at once",
            )
        if self._by_peer[peer] >= MAX_WATCHES_PER_PEER:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {MAX_WATCHES_PER_PEER} health Watch streams at once from one address; "
                "Check answers at once",
            )
        self.num_watches += 1
        self._by_peer[peer] += 1
        try:
            await super().Watch(request, context)
        finally:
            self.num_watches -= 1
            self._by_peer[peer] -= 1
            if not self._by_peer[peer]:
                del self._by_peer[peer]


def _address(peer: str) -> str:
    """The caller's address without its port: 'ipv4:10.0.0.7:53422' -> 'ipv4:10.0.0.7',
    'ipv6:[::1]:53422' -> 'ipv6:[::1]'; a Unix socket's peer as it is."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer
