"""A client's channel to either service: size limits, keepalive, retries of idempotent calls, TLS, token.

The message-size cap is the same number on both sides: `DEFAULT_MAX_MESSAGE_BYTES` unless configured,
and a server's options (`server.py`) use it too. Idempotent unary calls (Embed, Tokenize, GetModelInfo,
health Check) are retried by gRPC itself when they end UNAVAILABLE (a server restarting, a connection
reset): `service_config`, with throttling so that a dead server does not get a retry storm.
Generate is retried the same way only until its call is committed: gRPC stops retrying once the
server's first response (the `accepted` event) arrives, so a stream that has begun is never replayed,
while one that no server took (a replica killed as the call went out, a server loading or draining)
goes to the next attempt. A request larger than gRPC's per-call retry buffer (256 KiB, an embedding
prompt of some size) is committed as it is sent and never retried.

`ChannelSecurity` turns on TLS (a CA to trust, optionally a client certificate for mutual TLS) and
a bearer token, sent as `authorization: Bearer <token>` on every call (see `tandem.client.auth`).

Replicas: an address that names several servers (`host:port,host:port`, a list, or
`dns:///name:port`, e.g. a Kubernetes headless Service) is balanced by gRPC itself: the
`round_robin` policy over every server, with client-side health checking (`grpc.health.v1` Watch on
each connection), so a replica that stops, drains or is NOT_SERVING gets no new calls. A plain
`host:port` keeps gRPC's default, one connection to one server. A channel opened with
`is_health_checked=False` balances without watching: its opener knows which servers serve (the
gateway, `tandem.gateway.replicas`), and round_robin still skips a server it cannot connect to.
A balanced channel's first calls wait (1 s at most) until each server has connected or failed
(`first_calls`): round_robin picks only connected servers, and a fresh channel's first burst all went
to the one that connected first.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .auth import bearer_token, read_token
from .first_calls import FirstCallsGate, health_probe, name_resolver
from .flag_files import MAX_CA_BUNDLE_BYTES, read_bounded

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


def channel_target(address: str | Sequence[str]) -> tuple[str, bool]:
    """The gRPC target of `address`, and whether it names several servers (then it is balanced).

    "host:port" is one server. "a:1,b:2" (or a list) is several: gRPC's static `ipv4:`/`ipv6:`
    list, host names resolved once, here. "dns:///name:port" is every address the name resolves to,
    re-resolved by gRPC as servers come and go. Raises ValueError for an address it cannot use.
    """
    addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address)]
    if not addresses or not all(addresses):
        raise ValueError(f"address {address!r}: expected host:port, several separated by commas, or dns:///")
    if len(addresses) == 1:
        if addresses[0].startswith("dns:"):
            return addresses[0], True
        scheme = next((s for s in _GRPC_SCHEMES if addresses[0].startswith(s)), None)
        if scheme is None:
            _host_port(addresses[0])  # gRPC took port 116328 as 50792 (mod 65536), and "::::" as a name
        elif scheme in ("ipv4:", "ipv6:"):
            _host_port(addresses[0].removeprefix(scheme))  # the same wrap happens behind these
        return addresses[0], False
    resolved = [_ip_address(a) for a in addresses]
    families = {ip.version for ip, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"address {address!r}: mixes IPv4 and IPv6 servers; gRPC balances one family")
    if families == {4}:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in resolved), True
    return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in resolved), True


def server_of(address: str | Sequence[str]) -> tuple[str, int | None] | None:
    """The server `address` names, as the semantic conventions' `server.address` and `server.port`: a
    host:port's host and port, a dns: target's name and port (the group its addresses serve; without a
    port, gRPC's default for the name, 443, the port its calls go to), a unix socket's path (no port);
    None for several servers (no one of them is the call's) or another form."""
    addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address)]
    if len(addresses) != 1:
        return None
    (target,) = addresses
    if target.startswith("unix:"):  # unix:path, or unix:///absolute/path (an empty authority)
        path = target.removeprefix("unix:")
        return (path[2:] if path.startswith("///") else path), None
    if target.startswith("unix-abstract:"):
        return target.removeprefix("unix-abstract:"), None
    if target.startswith("dns:"):  # dns:name:port, dns:///name:port, dns://resolver/name:port
        target = target.removeprefix("dns:")
        if target.startswith("//"):
            target = target[2:].partition("/")[2]
        if not target.rpartition("]")[2].count(":"):  # no port: gRPC's resolver gives the name's 443
            target += f":{DNS_DEFAULT_PORT}"
    elif target.startswith("ipv6:"):  # a URI: a zone's "%" is written %25 (fe80::1%25eth0)
        target = urllib.parse.unquote(target.removeprefix("ipv6:"))
    else:
        target = target.removeprefix("ipv4:")
    try:
        return _host_port(target)
    except ValueError:
        return None


# The port gRPC's dns resolver gives a name without one, plaintext or not (C-core's kDefaultSecurePort,
# "https"; its naming doc: "If not specified, 443 is used").
DNS_DEFAULT_PORT = 443


# gRPC's own target schemes other than dns: (its naming doc), passed to gRPC as written: one server
# each here (a comma splits the address above); ipv4:/ipv6: still get the port check.
_GRPC_SCHEMES = ("ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")

# A host name as gRPC's resolver takes it (ASCII: an internationalised name goes in its xn-- form), or
# an IPv4 address; an IPv6 address goes in brackets.
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _host_port(address: str) -> tuple[str, int]:
    """The host (an IPv6 address without its brackets) and the port of "host:port", unresolved: a
    name that resolves only later (a Kubernetes Service not yet created) is still an address. Raises
    ValueError."""
    host, sep, port = address.rpartition(":")
    # str.isdigit takes '²' and '٨٠' too; at most 5 digits before int(), which refuses 4,300 in words
    # of its own
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise ValueError(f"address {address!r}: expected host:port, a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        except ValueError:
            raise ValueError(f"address {address!r}: {host} is not an IPv6 address in brackets") from None
    if not _HOST_NAME.fullmatch(host):
        raise ValueError(
            f"address {address!r}: expected host:port, the host a name or an IP address (IPv6 in "
            "brackets: [::1]:50051)"
        )
    return host, int(port)


def _ip_address(address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, port = _host_port(address)
    try:
        return ipaddress.ip_address(host), port
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"address {address!r}: {host} does not resolve ({error.strerror})") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first: `localhost` is both
    return ipaddress.ip_address(infos[0][4][0]), port


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a server that uses TLS and/or bearer tokens. The default is plaintext."""

    is_tls: bool = False  # TLS even without the PEM fields (then the system's trusted roots).
    root_certificates: bytes | None = None  # PEM CA(s) trusted for the server certificate.
    certificate_chain: bytes | None = None  # mutual TLS: this client's certificate, PEM.
    private_key: bytes | None = field(default=None, repr=False)  # mutual TLS: its key, PEM.
    token: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer <token>`.

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and the other way round")

    @property
    def uses_tls(self) -> bool:
        return self.is_tls or any(
            v is not None for v in (self.root_certificates, self.certificate_chain, self.private_key)
        )

    @classmethod
    def from_files(
        cls,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token_file: Path | None = None,
        is_tls: bool = False,
    ) -> ChannelSecurity:
        """From PEM files and a token file (its first token), as the CLI flags name them. Each is read
        only as a regular file of at most 1 MiB, as the token files are (`flag_files`): read whole,
        /dev/zero grew the process without end. Raises ValueError naming the file and what it is."""

        def read(path: Path | None, what: str) -> bytes | None:
            if path is None:
                return None
            try:
                return read_bounded(Path(path), MAX_CA_BUNDLE_BYTES, f"{what} (1 MiB)")
            except ValueError as error:
                raise ValueError(f"cannot read {what}: {error}") from None

        return cls(
            is_tls=is_tls,
            root_certificates=read(ca, "a CA bundle"),
            certificate_chain=read(cert, "a client certificate chain"),
            private_key=read(key, "a client private key"),
            token=None if token_file is None else read_token(token_file),
        )


PLAINTEXT = ChannelSecurity()


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
) -> grpc.aio.Channel:
    """A channel to one of our services (`service`, e.g. "tandem.v1.Decoder", names its health
    status): size limits, keepalive, retries, TLS and token as asked; balanced over several servers,
    watching each one's health unless not `is_health_checked`.
    `own_connection`: never share a connection with another channel to the same target (gRPC shares
    them by default), so the server sees this channel's calls as one caller of their own.
    `authority`: the name the servers go by (their TLS certificates' name) where `address` holds
    their IP addresses, looked up from it by the caller.

    Raises ValueError for an address it cannot use."""
    target, is_balanced = channel_target(address)
    options = client_channel_options(max_message_bytes, is_balanced, service if is_health_checked else None)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    chain = [*interceptors, *(details_interceptors(bearer_token(security.token)) if security.token else [])]
    gate = None
    if is_balanced:  # its first burst waits for every server's connection (`first_calls`)
        # A probe dials one of a `dns:` name's addresses but goes by the name, as the channel does:
        # the servers' TLS certificates name the name, and a probe going by the IP failed their check.
        named = server_of(address) if authority is None and target.startswith("dns:") else None
        probe_authority = authority if named is None else named[0]

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

        probe = health_probe(open_probe_channel, service if is_health_checked else None, security.uses_tls)
        gate = FirstCallsGate(_servers(address, target), probe)
        chain.extend(details_interceptors(gate.held))
    channel = _channel(target, options, security, chain or None)
    if gate is not None:
        gate.attach(channel)
    return channel


# Rewrites a call's details before the call goes out: adds the token, holds the first calls.
DetailsRewrite = Callable[[grpc.aio.ClientCallDetails], Awaitable[grpc.aio.ClientCallDetails]]


def details_interceptors(rewrite: DetailsRewrite) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors running `rewrite` on every call's details: one per call kind, as an aio channel
    files an interceptor under its first kind only. No RPC of ours streams requests today; the
    client-streaming two are kept so that one added later is not sent without its token."""
    return [kind(rewrite) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class _Rewriting:
    def __init__(self, rewrite: DetailsRewrite) -> None:
        self._rewrite = rewrite


class _UnaryUnary(_Rewriting, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request)


class _UnaryStream(_Rewriting, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request)


class _StreamUnary(_Rewriting, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request_iterator)


class _StreamStream(_Rewriting, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request_iterator)


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


def _servers(
    address: str | Sequence[str], target: str
) -> tuple[str, ...] | Callable[[], Awaitable[tuple[str, ...]]]:
    """A balanced `target`'s servers: its static list's, or a `dns:` name's as it resolves then."""
    if target.startswith("dns:"):
        server = server_of(address)
        return () if server is None or server[1] is None else name_resolver(server[0], server[1])
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
