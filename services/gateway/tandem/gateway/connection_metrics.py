"""The counters of connections at --max-connections (`connections.py`), read at collection.

A gateway at its bound closes connections waiting for a request head (a keep-alive one between two
requests among them) to let new ones in, and refuses new ones 503 where none waits: an operator sees
both grow, and a WARNING line at most every 10 s names the address that lost the most. No label per
address: callers' addresses are as many as connect, too many series.

The reader's export thread calls these, not the event loop that counts: each reads one int the loop
replaces whole.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import metrics

from tandem.gateway.connections import ConnectionGuard

# The gateway's own names, beside answer_metrics.py's (`tandem.gateway.*`).
TANDEM_GATEWAY_CONNECTIONS_EVICTED = "tandem.gateway.connections.evicted"
TANDEM_GATEWAY_CONNECTIONS_REFUSED = "tandem.gateway.connections.refused"


def observe_connections(meter: metrics.Meter, guard: ConnectionGuard) -> None:
    """Observable counters of `guard`'s connections closed and refused at its bound."""

    def evicted(_: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(guard.num_evicted)]

    def refused(_: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(guard.num_refused)]

    meter.create_observable_counter(
        TANDEM_GATEWAY_CONNECTIONS_EVICTED,
        [evicted],
        unit="{connection}",
        description="Connections waiting for a request head closed to let a new one in at --max-connections",
    )
    meter.create_observable_counter(
        TANDEM_GATEWAY_CONNECTIONS_REFUSED,
        [refused],
        unit="{connection}",
        description="New connections answered 503 at --max-connections, none waiting for a request head",
    )
