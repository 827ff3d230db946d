"""A client's channel to either service: size limits, keepalive, retries of idempotent calls, TLS, token.

The message-size cap is the same number on both sides: `DEFAULT_MAX_MESSAGE_BYTES` unless configured,
and a server's options (`server_options.py`) use it too. Idempotent unary calls (Embed, Tokenize,
GetModelInfo, health Check) are retried by gRPC itself when they end UNAVAILABLE (a server restarting,
a connection reset): `service_config`, with throttling so that a dead server does not get a retry storm.
Generate is retried the same way only until its call is committed: gRPC stops retrying once the
server's first response (the `accepted` event) arrives, so a stream that has begun is never replayed,
while one that no server took (a replica killed as the call went out, a server loading or draining)
goes to the next attempt. A request larger than gRPC's per-call retry buffer (256 KiB, an embedding
prompt of some size) is committed as it is sent and never retried.

`ChannelSecurity` (`security`) turns on TLS (a CA to trust, optionally a client certificate for mutual
TLS) and a bearer token, sent as `authorization: Bearer <token>` on every call (see `tandem.client.auth`).

Replicas: an address that names several servers (`host:port,host:port`, a list, or
`dns:///name:port`, e.g. a Kubernetes headless Service; `addresses.channel_target`) is balanced by
gRPC itself: the `round_robin` policy over every server, with client-side health checking
(`grpc.health.v1` Watch on each connection), so a replica that stops, drains or is NOT_SERVING gets no
new calls. A plain `host:port` keeps gRPC's default, one connection to one server. A channel opened
with `is_health_checked=False` balances without watching: its opener knows which servers serve (the
gateway, `tandem.gateway.replicas`), and round_robin still skips a server it cannot connect to.
A balanced channel's first calls wait (1 s at most) until each server has connected or failed
(`first_calls`): round_robin picks only connected servers, and a fresh channel's first burst all went
to the one that connected first.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

# ChannelSecurity, PLAINTEXT, channel_target and details_interceptors stay importable from here too:
# the gateway and tandem.common.client_security_flags import them so.
from .addresses import channel_target, dns_name
from .auth import bearer_token
from .call_details import details_interceptors
from .first_calls import FirstCallsGate, health_probe, name_resolver
from .security import PLAINTEXT, ChannelSecurity

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # 8k positions x 4096 hidden in bf16.

# A ping every 30 s, the connection closed when one is unanswered in 10 s: a server gone without
# closing its connections (stopped, its host lost) is found by the client's next ping.
KEEPALIVE_MS = (30_000, 10_000)
# Over several servers, a ping every 2 s, unanswered in 3 s: a replica stopped (SIGSTOP, a frozen VM)
# leaves its connection and its health Watch open and says nothing, so the channel's round_robin kept
# sending it half of all new calls, each hung to its deadline, until the 30 s keepalive gave up on it
# (58 s under steady calls to the decoder's --encoder X,Y); now its connection closes within 5 s and
# the calls go to the others (an Embed in flight there is retried on them: UNAVAILABLE). Pings are
# answered by gRPC's own threads, not the server's busy event loop, and servers take them this often
# (max_ping_strikes 0, `tandem.common.server`).
REPLICA_KEEPALIVE_MS = (2_000, 3_000)

_RETRIED_METHODS = [
    {"service": "tandem.v1.Encoder", "method": "Embed"},
    {"service": "tandem.v1.Encoder", "method": "Tokenize"},
    {"service": "tandem.v1.Encoder", "method": "GetModelInfo"},
    {"service": "tandem.v1.Decoder", "method": "Tokenize"},
    {"service": "tandem.v1.Decoder", "method": "GetModelInfo"},
    {"service": "grpc.health.v1.Health", "method": "Check"},
    # Not idempotent once begun, but gRPC retries only before the first response: see the docstring.
    {"service": "tandem.v1.Decoder", "method": "Generate"},
]
# Up to 5 attempts within the call's own deadline, about 1.5 s of backoff in all. Throttling: each
# failed attempt costs a token, each success earns 0.1, and retries stop below half of maxTokens.
_RETRY_CONFIG = {
    "methodConfig": [
        {
            "name": _RETRIED_METHODS,
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
    "retryThrottling": {"maxTokens": 20, "tokenRatio": 0.1},
}


def service_config(is_balanced: bool = False, health_service: str | None = None) -> str:
    """The channel's service config: the retry policy; `is_balanced`, also round-robin over every
    resolved server, with `health_service` each one used only while its health for that service is
    SERVING (a Watch stream per server)."""
    config: dict[str, Any] = dict(_RETRY_CONFIG)
    if is_balanced:
        config["loadBalancingConfig"] = [{"round_robin": {}}]
        if health_service is not None:
            config["healthCheckConfig"] = {"serviceName": health_service}
    return json.dumps(config)


def client_channel_options(
    max_message_bytes: int, is_balanced: bool = False, health_service: str | None = None
) -> list[tuple[str, Any]]:
    """`channel_options` plus the retry policy for idempotent calls (and balancing, see service_config);
    over several servers, a keepalive that finds a stopped one within seconds (REPLICA_KEEPALIVE_MS)."""
    return [
        *channel_options(max_message_bytes, REPLICA_KEEPALIVE_MS if is_balanced else KEEPALIVE_MS),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(is_balanced, health_service)),
        # While a server is down the channel waits longer and longer between reconnects (gRPC's
        # default grows to 120 s); a restarted server is found again within 5 s.
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


def open_channel(
    address: str | Sequence[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    security: ChannelSecurity = PLAINTEXT,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    service: str = "",
    own_connection: bool = False,
    is_health_checked: bool = True,
    authority: str | None = None,
    is_replica: bool = False,
) -> grpc.aio.Channel:
    """A channel to one of our services (`service`, e.g. "tandem.v1.Decoder", names its health
    status): size limits, keepalive, retries, TLS and token as asked; balanced over several servers,
    watching each one's health unless not `is_health_checked`.
    `own_connection`: never share a connection with another channel to the same target (gRPC shares
    them by default), so the server sees this channel's calls as one caller of their own.
    `authority`: the name the servers go by (their TLS certificates' name) where `address` holds
    their IP addresses, looked up from it by the caller.
    `is_replica`: `address` is one of several replicas that the opener watches itself (the gateway's,
    `tandem.gateway.replica_channel`): the options of a channel over several, the replicas' keepalive
    and round_robin (over its one connection), though it names one server; its health not watched.

    Raises ValueError for an address it cannot use."""
    target, is_balanced = channel_target(address)
    is_watched = is_health_checked and not is_replica
    options = client_channel_options(
        max_message_bytes, is_balanced or is_replica, service if is_watched else None
    )
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    chain = [*interceptors, *(details_interceptors(bearer_token(security.token)) if security.token else [])]
    gate = None
    if is_balanced:  # its first burst waits for every server's connection (`first_calls`)
        # A probe dials one of a `dns:` name's addresses but goes by the name, as the channel does:
        # the servers' TLS certificates name the name, and a probe going by the IP failed their check.
        name = dns_name(target)  # checked by channel_target: a dns: target is passed to gRPC as written
        probe_authority = authority if authority is not None or name is None else name.host.strip("[]")

        def open_probe_channel(server: str) -> grpc.aio.Channel:
            # Retrying nothing, so a refusal ends the probe at once; a connection of its own, so it
            # starts after the balanced channel's. Health needs no token (`auth.OPEN_SERVICES`).
            probe_options = [
                *channel_options(max_message_bytes),
                ("grpc.enable_retries", 0),
                ("grpc.use_local_subchannel_pool", 1),
            ]
            if probe_authority is not None:
                probe_options.append(("grpc.default_authority", probe_authority))
            return _channel(server, probe_options, security, None)

        probe = health_probe(open_probe_channel, service if is_watched else None, security.uses_tls)
        gate = FirstCallsGate(_servers(target), probe)
        chain.extend(details_interceptors(gate.held))
    channel = _channel(target, options, security, chain or None)
    if gate is not None:
        gate.attach(channel)
    return channel


def _channel(
    target: str,
    options: list[tuple[str, Any]],
    security: ChannelSecurity,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None,
) -> grpc.aio.Channel:
    if not security.uses_tls:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        security.root_certificates, security.private_key, security.certificate_chain
    )
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


def _servers(target: str) -> tuple[str, ...] | Callable[[], Awaitable[tuple[str, ...]]]:
    """A balanced `target`'s servers: its static list's, or a `dns:` name's as it resolves then."""
    name = dns_name(target)
    if name is not None:
        return name_resolver(name.host.strip("[]"), name.port)
    return tuple(target.partition(":")[2].split(","))


def channel_options(
    max_message_bytes: int, keepalive_ms: tuple[int, int] = KEEPALIVE_MS
) -> list[tuple[str, Any]]:
    """Options for clients of our services: same size cap as the server, keepalive it permits
    (`keepalive_ms`: a ping this often, the connection closed when one is unanswered this long)."""
    ping_ms, timeout_ms = keepalive_ms
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # Any ping unanswered this long closes the connection too: while one is in flight (gRPC's own
        # flow-control ping, sent as calls go out) no keepalive ping is sent, and its timeout was
        # gRPC's default minute.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
