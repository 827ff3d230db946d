"""One grpc.aio server bootstrap for both services.

Every server gets the same things: explicit message-size limits (the same number the client
uses), keepalive settings that tolerate long silent streams, `grpc.health.v1` that reports
NOT_SERVING until the service says it is ready, server reflection (grpcurl works), the error
interceptor, and a graceful stop (`running_server.py`). Its settings are `ServerOptions`
(`server_options.py`).

Every server bounds the calls it holds (`max_concurrent_rpcs`): one past the bound is answered
RESOURCE_EXHAUSTED naming the bound when the server takes it up, with a RetryInfo and an ErrorInfo
CALL_LIMIT in the domain of the server's service (`call_bound.py`: grpc.aio's own bound, a little
above, says "Concurrent RPC limit exceeded!" and no number), a status that retry policies back off
from. Before that, a call waits in gRPC core's queue of calls the server
has not taken up yet (grpc.aio takes them one at a time on the event loop): core drops calls from
that queue at random past 1,000 and all past 3,000, each CANCELLED, which its caller cannot tell from
its own cancel (2,500 calls at once from 4 channels: 311 CANCELLED). That queue is sized here to hold
at least as many calls as may run, so a burst is answered, by the service or by the bound, up to the
queue's size: past it core still ends each call CANCELLED, with no status and no hook to give one
(15,000 calls at once at the defaults: 4,373; docs/RELIABILITY.md).

Start-up problems are found before anything listens, each as one ConfigError naming its field: a
TLS key that does not match its certificate, a port already in use.

Optionally TLS (`server_tls.py`: a server certificate; with a client CA, mutual TLS that refuses
callers without a certificate it signed) and bearer tokens (`tandem.client.auth`: every service but
health needs one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.client import error_reasons as reasons
from tandem.client.auth import AuthInterceptor
from tandem.client.errors import ConfigError
from tandem.client.status import ErrorInterceptor
from tandem.common.call_bound import CallBound, grpc_bound
from tandem.common.call_over_filter import CALL_OVER_FILTER, GRPC_LOGGER
from tandem.common.health import BoundedHealth, max_watches
from tandem.common.listening import (
    PORT_TRIES,
    Listen,
    check_port_free,
    free_port_of,
    in_use_at,
    is_localhost,
    listen_plan,
)
from tandem.common.running_server import CutListener, RunningServer
from tandem.common.server_options import DEFAULT_MAX_CONCURRENT_RPCS, INT32_MAX, ServerOptions
from tandem.common.server_tls import TlsOptions

# What a service's main imports from here: what this module defines (Service, start_server) and, from
# their own modules, the options it starts from and the server it hands back, so one import serves.
__all__ = [
    "DEFAULT_MAX_CONCURRENT_RPCS",
    "RunningServer",
    "ServerOptions",
    "Service",
    "TlsOptions",
    "start_server",
]

log = logging.getLogger(__name__)


def _server_options(options: ServerOptions) -> list[tuple[str, Any]]:
    max_pending_rpcs = max(grpc_bound(options.max_concurrent_rpcs), DEFAULT_MAX_CONCURRENT_RPCS)
    return [
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", options.max_message_bytes),
        # Calls not yet taken up: none dropped (CANCELLED) below the bound, all above it; the two
        # equal so that no call is dropped at random. Never fewer than may run: a burst the server
        # would answer RESOURCE_EXHAUSTED must reach it.
        ("grpc.server.max_pending_requests", max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", max_pending_rpcs),
        # Streams of a slow generation can be silent for a while, and a replica's watching channel pings
        # every 2 s (REPLICA_KEEPALIVE_MS) to tell a stopped process from a busy one: pings are welcome
        # down to 1 s apart. gRPC core's name for this is min_ping_interval_without_data_ms (its macro
        # says RECV); the name here before, min_recv_..., is read by nothing, so every 2 s ping was a
        # strike, harmless only because strikes are not counted (0).
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        # A one-replica channel keeps pinging between its calls: else each ping with no call open is a
        # strike (gRPC allows those every 2 h only).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
        ("grpc.max_connection_age_ms", round(options.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", INT32_MAX),  # a stream running then ends when it ends
    ]


@dataclass(frozen=True)
class Service:
    """A servicer to mount: its full proto name and the generated `add_*_to_server` function."""

    name: str  # e.g. "tandem.v1.Decoder"
    servicer: object
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    # Method name -> the most bytes its request can usefully have (None while unknown): a longer
    # request is refused INVALID_ARGUMENT from its size, unparsed (tandem.client.oversized).
    max_request_bytes: Mapping[str, Callable[[], int | None]] = field(default_factory=dict)


def _max_request_bytes(services: Sequence[Service]) -> dict[str, Callable[[], int | None]]:
    return {f"/{s.name}/{method}": bound for s in services for method, bound in s.max_request_bytes.items()}


def _bare_server(options: ServerOptions, services: Sequence[Service]) -> grpc.aio.Server:
    """The server with its interceptors and no service yet: it is bound first, and one that loses its
    port at an address is started and stopped to let the others go, answering UNIMPLEMENTED to a
    call that reaches it meanwhile rather than serving it (`_serve` adds the services)."""
    # The bound on calls comes first (it counts every call, as grpc.aio does), then authentication: a
    # denied call reaches neither tracing nor the servicer.
    bound = CallBound(
        options.max_concurrent_rpcs, reasons.domain_of(services[0].name if services else "tandem")
    )
    auth = [AuthInterceptor(options.auth_tokens)] if options.auth_tokens else []
    return grpc.aio.server(
        interceptors=[bound, *auth, *options.interceptors, ErrorInterceptor(_max_request_bytes(services))],
        options=_server_options(options),
        maximum_concurrent_rpcs=grpc_bound(options.max_concurrent_rpcs),
    )


def _serve(server: grpc.aio.Server, options: ServerOptions, services: Sequence[Service]) -> BoundedHealth:
    """Health, the services and reflection, added to the bound server; its health."""
    health = BoundedHealth(max_watches(options.max_concurrent_rpcs))  # health needs no token
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [s.name for s in services]
    for service in services:
        service.add_to_server(service.servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return health


class _TakenSinceChecked(Exception):
    """Another process took the port at one of the addresses after the check saw it free."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error))
        self.error = error


def _add_ports(
    server: grpc.aio.Server, plan: Listen, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    """Binds each of `plan`'s targets on one port (the first's pick where `port` is 0); the port.
    Raises _TakenSinceChecked, or ConfigError("host") where an address refuses for another cause."""
    for address, target in zip(plan.addresses, plan.targets(port), strict=True):
        try:
            if credentials is not None:
                bound = server.add_secure_port(target, credentials)
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError as error:  # gRPC's "Failed to bind"
            bound, cause = 0, f" ({error})"
        else:
            cause = ""
        if bound == 0:
            taken = in_use_at(plan, address, port) if port else None
            if taken is not None:
                raise _TakenSinceChecked(taken)
            raise ConfigError("host", f": cannot listen on {target}{cause}")
        port = bound
    return port


async def start_server(options: ServerOptions, services: Sequence[Service]) -> RunningServer:
    logging.getLogger(GRPC_LOGGER).addFilter(CALL_OVER_FILTER)  # added once: filters are a set
    plan = listen_plan(options.host)
    check_port_free(options.host, options.port)  # a one-line error instead of gRPC's traceback
    credentials = options.tls.server_credentials() if options.tls is not None else None  # read once
    for _ in range(PORT_TRIES):
        server = _bare_server(options, services)
        port = options.port or free_port_of(plan)
        try:
            port = _add_ports(server, plan, port, credentials)
            break
        except (_TakenSinceChecked, ConfigError) as failure:
            # The addresses it did bind stay bound until it has run (a stop alone, or dropping it,
            # keeps them): started and stopped at once, before its port is said anywhere.
            await server.start()
            await server.stop(None)
            if isinstance(failure, ConfigError):
                raise
            if options.port:
                raise failure.error from None
    else:
        raise ConfigError("port", f"0: another process took each port picked for {options.host}")
    health = _serve(server, options, services)
    names = [s.name for s in services]
    listeners = [i for i in options.interceptors if isinstance(i, CutListener)]
    running = RunningServer(server, health, port, names, listeners)
    for name in ["", *names]:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info(
        "listening on %s (%s; %s, %s)",
        ", ".join(plan.targets(port)),
        ", ".join(names) or "health only",
        _describe_tls(options.tls),
        "bearer tokens required" if options.auth_tokens else "no authentication",
    )
    if (
        options.auth_tokens
        and options.tls is None
        and options.host not in ("127.0.0.1", "::1")
        and not is_localhost(options.host)
    ):
        log.warning("bearer tokens without TLS travel in the clear: use --tls-cert/--tls-key off loopback")
    return running


def _describe_tls(tls: TlsOptions | None) -> str:
    if tls is None:
        return "plaintext"
    return "mutual TLS" if tls.client_ca_file is not None else "TLS"
