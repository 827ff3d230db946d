"""A channel to one replica: the replicas' keepalive (a ping every 2 s, unanswered in 3 s), not one
server's (30 s + 10 s).

NOTE: why not `open_channel`'s channel for one address. It gives one address the keepalive of a single
server, where nothing else could take the calls: a decoder stopped for good (SIGSTOP, a frozen VM) left
its connection open, and the gateway found it only when a ping went unanswered. Over one decoder the
gateway's watch then kept it serving ~12 s (a late Check leaves the only serving replica in:
`Replicas._late_check`), and the completions sent meanwhile hung 28-60 s (the 40 s keepalive, then a
20 s reconnect that never got the HTTP/2 SETTINGS frame). Pings are answered by gRPC's own threads,
not the server's event loop, so a replica whose loop is held a few seconds keeps answering them: the
replica keepalive tells a stopped process (its Watch ends within 5 s, a definite state: out at once)
from a held one (its Watch stays open, its late Checks leave it serving). So the watch's channel to
each replica, and a caller's channel over the one replica left, get the replicas' keepalive, as a
channel over several does (`tandem.client.channel.REPLICA_KEEPALIVE_MS`): `open_channel`'s
`is_replica`.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from tandem.client.channel import ChannelSecurity, open_channel


def open_replica_channel(
    replica: str,
    max_message_bytes: int,
    security: ChannelSecurity,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    own_connection: bool = False,
    authority: str | None = None,
) -> grpc.aio.Channel:
    """A channel to `replica` ("ip:port", or one address) as `open_channel` opens one over several,
    watching nothing: its size limits, retries, TLS and token, and the replicas' keepalive (round_robin
    over one server: its one connection, as one server's default). `own_connection` and `authority` as
    `open_channel` takes them."""
    return open_channel(
        replica,
        max_message_bytes,
        security,
        interceptors,
        own_connection=own_connection,
        authority=authority,
        is_replica=True,
    )
