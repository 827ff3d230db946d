"""One grpc.aio server bootstrap for both services.

Every server gets the same things: explicit message-size limits (the same number the client
uses), keepalive settings that tolerate long silent streams, `grpc.health.v1` that reports
NOT_SERVING until the service says it is ready, server reflection (grpcurl works), the error
interceptor, and a graceful stop: health goes NOT_SERVING, new RPCs are refused, and in-flight
ones get `grace_s` to finish before they are cancelled (their callers see UNAVAILABLE).

Optionally TLS (a server certificate; with a client CA, mutual TLS that refuses callers without a
certificate it signed) and bearer tokens (`common.auth`: every service but health needs one).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from common.auth import AuthInterceptor
from common.channel import DEFAULT_MAX_MESSAGE_BYTES
from common.status import ErrorInterceptor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsOptions:
    """PEM files of a TLS server; read when the server starts, so rotated files need a restart."""

    cert_file: Path  # the server's certificate chain, leaf first.
    key_file: Path  # its private key (unencrypted PEM).
    client_ca_file: Path | None = None  # set: mutual TLS, clients need a certificate this CA signed.

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS {name} {path} is not a readable file")

    @classmethod
    def from_paths(
        cls, cert: Path | None, key: Path | None, client_ca: Path | None = None
    ) -> TlsOptions | None:
        """From the `--tls-*` flags: None when none is given; a certificate needs its key."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS first)")
            return None
        if cert is None or key is None:
            raise ValueError("--tls-cert and --tls-key go together")
        return cls(Path(cert), Path(key), None if client_ca is None else Path(client_ca))

    def server_credentials(self) -> grpc.ServerCredentials:
        root = Path(self.client_ca_file).read_bytes() if self.client_ca_file is not None else None
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())],
            root_certificates=root,
            require_client_auth=root is not None,
        )


@dataclass(frozen=True)
class ServerOptions:
    """Transport settings shared by both services; built once from each service's config."""

    host: str = "127.0.0.1"  # listen address; "0.0.0.0" in containers.
    port: int = 0  # 0 = pick a free port (tests); the bound port is on RunningServer.port.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # send and receive cap, in bytes.
    grace_s: float = 10.0  # in-flight RPCs get this long to finish on shutdown.
    interceptors: Sequence[grpc.aio.ServerInterceptor] = field(default_factory=tuple)  # e.g. tracing.
    tls: TlsOptions | None = None  # None: plaintext.
    auth_tokens: frozenset[str] = field(default=frozenset(), repr=False)  # accepted; empty: no auth.


def _server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Streams of a slow generation can be silent for a while: allow client pings every 10 s.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


@dataclass(frozen=True)
class Service:
    """A servicer to mount: its full proto name and the generated `add_*_to_server` function."""

    name: str  # e.g. "tandem.v1.Decoder"
    servicer: object
    add_to_server: Callable[[Any, grpc.aio.Server], None]


class RunningServer:
    """A started server. Health starts NOT_SERVING for every mounted service."""

    def __init__(self, server: grpc.aio.Server, health: HealthServicer, port: int, names: list[str]):
        self.server = server
        self.health = health
        self.port = port
        self.service_names = names

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        """Health NOT_SERVING, refuse new RPCs, give in-flight ones `grace_s`, then cancel them."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(options: ServerOptions, services: Sequence[Service]) -> RunningServer:
    # Authentication comes first: a denied call reaches neither tracing nor the servicer.
    auth = [AuthInterceptor(options.auth_tokens)] if options.auth_tokens else []
    server = grpc.aio.server(
        interceptors=[*auth, *options.interceptors, ErrorInterceptor()],
        options=_server_options(options.max_message_bytes),
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [s.name for s in services]
    for service in services:
        service.add_to_server(service.servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{options.host}:{options.port}"
    if options.tls is not None:
        port = server.add_secure_port(address, options.tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {options.host}:{options.port}")
    running = RunningServer(server, health, port, names)
    for name in ["", *names]:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info(
        "listening on %s:%d (%s; %s, %s)",
        options.host,
        port,
        ", ".join(names) or "health only",
        _describe_tls(options.tls),
        "bearer tokens required" if options.auth_tokens else "no authentication",
    )
    if options.auth_tokens and options.tls is None and options.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("bearer tokens without TLS travel in the clear: use --tls-cert/--tls-key off loopback")
    return running


def _describe_tls(tls: TlsOptions | None) -> str:
    if tls is None:
        return "plaintext"
    return "mutual TLS" if tls.client_ca_file is not None else "TLS"


def install_signal_handlers(on_signal: Callable[[signal.Signals], None]) -> None:
    """Route SIGTERM and SIGINT to `on_signal` on the running loop (graceful stop, not a traceback)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
