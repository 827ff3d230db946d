"""grpc.health.v1 with its Watch streams bounded: the one service every caller reaches unauthenticated.

NOTE: why Watch is bounded, and how far. Health needs no token (kubelets and load balancers probe it),
and a Watch stream never ends on its own, so any caller could hold as many as it liked, each a call
the server counts against its `max_concurrent_rpcs` (server.py): 10,000 of them answered every
Generate, Embed and kubelet Check RESOURCE_EXHAUSTED. At most half of those places hold Watch streams
(one past: RESOURCE_EXHAUSTED naming the bound); the other half is the calls'. No bound per address:
a gateway watches each decoder from every caller's own channel (up to its --max-connections plus its
idle channels, 576 by default, all from its one address), so any share small enough to matter
against an attacker refused a busy gateway's callers. What is left: a caller with no token holding
every Watch place makes channels opened after it, which watch before they call, fail until its
streams end; the calls of channels already open, and Check, go on. Check is unbounded: it answers
at once.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer


def max_watches(max_concurrent_rpcs: int) -> int:
    """Watch streams a server with this bound on its calls holds at once: half, at least one."""
    return max(1, max_concurrent_rpcs // 2)


class BoundedHealth(HealthServicer):
    """grpc_health's servicer, less a Watch past `max_watches` at once."""

    def __init__(self, max_watches: int) -> None:
        super().__init__()
        self.max_watches = max_watches
        self.num_watches = 0

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if self.num_watches >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_watches} health Watch streams at once; Check answers at once",
            )
        self.num_watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.num_watches -= 1
