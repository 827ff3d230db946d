"""One grpc.aio server bootstrap for both services.

Every server gets the same things: explicit message-size limits (the same number the client
uses), keepalive settings that tolerate long silent streams, `grpc.health.v1` that reports
NOT_SERVING until the service says it is ready, server reflection (grpcurl works), the error
interceptor, and a graceful stop: health goes NOT_SERVING, calls are still taken for a short drain
notice (`DRAIN_NOTICE_S`) while health-watching clients move their new calls elsewhere, then new RPCs
are refused and in-flight ones get the rest of `grace_s` to finish (`DEFAULT_GRACE_S` unless
configured: the same for both services and `tandem up`). What is still running then is cancelled;
the decoder ends its streams first, with FINISH_REASON_ABORTED (`tandem.decoder.api.drain`).

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

Optionally TLS (a server certificate; with a client CA, mutual TLS that refuses callers without a
certificate it signed) and bearer tokens (`tandem.client.auth`: every service but health needs one).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.client import error_reasons as reasons
from tandem.client.auth import AuthInterceptor
from tandem.client.channel import DEFAULT_MAX_MESSAGE_BYTES
from tandem.client.errors import ConfigError
from tandem.client.flag_files import TlsFile, TlsFileError, TlsFiles, read_tls_files
from tandem.client.status import ErrorInterceptor
from tandem.common.call_bound import CallBound, grpc_bound
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

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0  # drain time on SIGTERM, of both services and of `tandem up`
# Calls served at once, streams included, unless a service asks for more: the decoder holds twice what
# its queue and batch hold (tandem.decoder.config.max_calls), so that its RESOURCE_EXHAUSTED naming
# --max-queue answers first. A call costs about 16 KB in gRPC core before it is taken up and about
# 20 KB once running, and no thread.
DEFAULT_MAX_CONCURRENT_RPCS = 10_000
# max_concurrent_rpcs at most: gRPC's channel arguments are C ints, which grpc.aio's bound and gRPC
# core's queue (call_bound.grpc_bound, 1/16 above it) must fit (past 2**31 - 1 the server failed to
# start with an OverflowError), and a million calls running already cost ~20 GB of gRPC's memory.
MAX_CONCURRENT_RPCS_LIMIT = 1_000_000
# A stop's notice: health NOT_SERVING while the server still takes calls, before gRPC's own stop
# refuses them. A balanced client picks a server for its call before it has heard of a NOT_SERVING
# or a GOAWAY sent in the same moment, and gRPC core cancels a call that arrives once its shutdown
# began (CANCELLED, which no retry policy retries): 4 callers back to back on loopback lost a call in
# 5 to 7 drains of 20, and none in 30 with this notice. A watching client hears NOT_SERVING within a
# round trip; a quarter second covers one on a loaded host or across a region. It counts within the
# grace: a stop never takes longer than asked.
DRAIN_NOTICE_S = 0.25
# Ten minutes: a reconnect (and a Watch asked again) costs a round trip or two, and a client refused
# its Watch by someone who held the places for a moment gets health-based routing back within it.
DEFAULT_MAX_CONNECTION_AGE_S = 600.0
_INT32_MAX = 2**31 - 1  # gRPC's "never" for a duration in ms
# The connection ages gRPC can take: one millisecond to its int32 of milliseconds (about 24.8 days).
MIN_CONNECTION_AGE_S = 0.001
MAX_CONNECTION_AGE_S = _INT32_MAX / 1000


def notice_within(grace_s: float) -> float:
    """The drain notice of a stop whose own calls end at `grace_s` (before gRPC's cut): a call taken
    after them would be ended by nothing but the cut."""
    return min(grace_s, DRAIN_NOTICE_S)


@dataclass(frozen=True)
class TlsOptions:
    """PEM files of a TLS server, read once when built and handed to gRPC as read (rotated files need a
    restart). Read so, a file replaced between the check and the start cannot pass one and serve the
    other, and each is bounded (`tandem.client.flag_files`): a 1 GiB certificate file (a certificate,
    then zeros) passed the check, read through OpenSSL, and then grew the server by 1 GiB, read whole."""

    cert_file: Path  # the server's certificate chain, leaf first.
    key_file: Path  # its private key (unencrypted PEM).
    client_ca_file: Path | None = None  # set: mutual TLS, clients need a certificate this CA signed.
    # What the three files held when checked, for `server_credentials`: set by __post_init__ only.
    files: TlsFiles = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Each file is a regular file of at most 1 MiB holding PEM, and the key is the certificate's
        and unencrypted: else gRPC fails later with "Failed to bind"."""
        try:
            files = read_tls_files(self.cert_file, self.key_file, self.client_ca_file)
        except TlsFileError as error:
            raise ConfigError(_TLS_FIELDS[error.file], f": {error}") from None
        object.__setattr__(self, "files", files)  # frozen: the one write, as it is built

    @classmethod
    def from_paths(
        cls, cert: Path | None, key: Path | None, client_ca: Path | None = None
    ) -> TlsOptions | None:
        """From the `--tls-*` flags: None when none is given; a certificate needs its key."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ConfigError("tls_client_ca", "needs --tls-cert and --tls-key (mTLS is TLS first)")
            return None
        if cert is None or key is None:
            raise ConfigError(
                "tls_cert" if cert is None else "tls_key", ": --tls-cert and --tls-key go together"
            )
        return cls(Path(cert), Path(key), None if client_ca is None else Path(client_ca))

    def server_credentials(self) -> grpc.ServerCredentials:
        """The credentials of the bytes checked when built; no file is read again."""
        root = self.files.ca_bundle
        return grpc.ssl_server_credentials(
            [(self.files.private_key, self.files.certificate_chain)],
            root_certificates=root,
            require_client_auth=root is not None,
        )


@dataclass(frozen=True)
class ServerOptions:
    """Transport settings shared by both services; built once from each service's config."""

    host: str = "127.0.0.1"  # listen address; "0.0.0.0" in containers.
    port: int = 0  # 0 = pick a free port (tests); the bound port is on RunningServer.port.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # send and receive cap, in bytes.
    grace_s: float = DEFAULT_GRACE_S  # in-flight RPCs get this long to finish on shutdown.
    interceptors: Sequence[grpc.aio.ServerInterceptor] = field(default_factory=tuple)  # e.g. tracing.
    tls: TlsOptions | None = None  # None: plaintext.
    auth_tokens: frozenset[str] = field(default=frozenset(), repr=False)  # accepted; empty: no auth.
    # Calls served at once, streams and health checks included; one past it: RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    # A connection is asked to go (GOAWAY, its calls left to finish) after this long, give or take
    # gRPC's 10 % jitter: its client reconnects and asks for its health Watch again. A Watch refused
    # while the server served (health.py) turned the client's health checking off for the
    # connection's life, so a replica failing later kept getting its share of calls for ever.
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        # gRPC takes it as a C int: past 2**31 - 1 the start failed with an OverflowError.
        if not 1024 <= self.max_message_bytes <= _INT32_MAX:
            raise ConfigError(
                "max_message_bytes",
                f"must be in 1024..{_INT32_MAX} (gRPC's int), got {self.max_message_bytes}",
            )
        # NaN passed `< 0`, and then meant no grace at all.
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ConfigError("grace_s", f"must be a finite number of seconds, 0 or more, got {self.grace_s}")
        # gRPC takes it as an int32 of milliseconds: past that the start failed with an OverflowError,
        # and under half a millisecond it rounded to 0 ms.
        if not MIN_CONNECTION_AGE_S <= self.max_connection_age_s <= MAX_CONNECTION_AGE_S:
            raise ConfigError(
                "max_connection_age_s",
                f"must be between {MIN_CONNECTION_AGE_S} and {MAX_CONNECTION_AGE_S} s (gRPC's int32 of "
                f"milliseconds), got {self.max_connection_age_s}",
            )
        if not 1 <= self.max_concurrent_rpcs <= MAX_CONCURRENT_RPCS_LIMIT:
            raise ConfigError(
                "max_concurrent_rpcs",
                f"must be in [1, {MAX_CONCURRENT_RPCS_LIMIT:,}], got {self.max_concurrent_rpcs:,}",
            )


# The config field each of a server's TLS files fills, for a refusal.
_TLS_FIELDS = {
    TlsFile.CERTIFICATE_CHAIN: "tls_cert",
    TlsFile.PRIVATE_KEY: "tls_key",
    TlsFile.CA_BUNDLE: "tls_client_ca",
}


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
        ("grpc.max_connection_age_grace_ms", _INT32_MAX),  # a stream running then ends when it ends
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


@runtime_checkable
class CutListener(Protocol):
    """An interceptor that tells apart the calls a stop cuts (tandem.client.telemetry's ServerSpans):
    gRPC gives a handler the same CancelledError for its caller's cancel and for the stop's."""

    def on_calls_cut(self) -> None:
        """The stop's grace has passed: every call still running is cancelled, UNAVAILABLE to its caller.
        Heard at every stop with no grace left (stop(None), stop(0)) whether or not a call runs, and the
        listener outlives the server (its ServerOptions may start another): it marks the calls running
        now, never a state that a later call would read."""


class RunningServer:
    """A started server. Health starts NOT_SERVING for every mounted service."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health: BoundedHealth,
        port: int,
        names: list[str],
        cut_listeners: Sequence[CutListener] = (),
    ):
        self.server = server
        self.health = health
        self.port = port
        self.service_names = names
        self.cut_listeners = cut_listeners  # told when stop() cuts the calls still running

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None, notice_s: float | None = None) -> None:
        """Health NOT_SERVING, calls still taken for the drain notice, then new RPCs refused and
        in-flight ones cancelled once `grace_s` has passed since the call (None: once the notice has
        passed, as gRPC's None cancels them at once; 0: at once, with no notice). The notice is
        `notice_s` (None: DRAIN_NOTICE_S), at most `grace_s`: a caller that ends its own calls before
        gRPC's cut gives `notice_within` the time it ends them in.

        Calls that arrive during the notice are served, not refused UNAVAILABLE: a client that does
        not watch health would keep picking this server for each call and retrying it elsewhere,
        each refusal costing a token of its retry throttling (11 back to back stop its retries), and
        it learns of the stop only from gRPC's GOAWAY, which the notice does not move: refused so, an
        unwatching client lost 149 calls in 20 drains, served 4."""
        await self.health.enter_graceful_shutdown()
        notice_s = DRAIN_NOTICE_S if notice_s is None else notice_s
        notice_s = notice_s if grace_s is None else min(grace_s, notice_s)
        if notice_s > 0:
            await asyncio.sleep(notice_s)
        cut_s = None if grace_s is None else grace_s - notice_s
        # gRPC cancels what still runs once `cut_s` has passed (None: at once), by an asyncio.wait_for on
        # this loop started after this timer: the listeners hear first, and a cancelled handler runs only
        # on a later turn of the loop.
        cut = None
        if self.cut_listeners:
            cut = asyncio.get_running_loop().call_later(max(cut_s or 0.0, 0.0), self._cutting)
        try:
            await self.server.stop(cut_s)
        finally:
            if cut is not None:
                cut.cancel()  # every call ended within the grace: nothing was cut

    def _cutting(self) -> None:
        # Each listener is told whatever another raised: one failing left those after it untold, their
        # calls cut by the stop counted as their callers' cancels.
        for listener in self.cut_listeners:
            try:
                listener.on_calls_cut()
            except Exception:
                log.exception("%s failed to hear of the stop's cut", type(listener).__qualname__)


def _max_request_bytes(services: Sequence[Service]) -> dict[str, Callable[[], int | None]]:
    return {f"/{s.name}/{method}": bound for s in services for method, bound in s.max_request_bytes.items()}


class _CallOverFilter(logging.Filter):
    """Drops grpc.aio's traceback for a message it could not send on a call that is already over.

    A send fails in gRPC's core only once the call has ended on the wire: its client cancelled or
    went away, its deadline passed, or the server is stopping. grpc.aio says nothing when it saw the
    client's cancel first, and logs the failed send with a traceback when the send's failure came
    first, a race: cancelling 640 unread streams logged 59 of them. Either way the call is over and
    its client knows why; nothing in it is the server's to fix.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(GRPC_FAILED_SEND_MESSAGE)


GRPC_LOGGER = "grpc._cython.cygrpc"
GRPC_FAILED_SEND_MESSAGE = "ExecuteBatchError raised in core"  # grpc/_cython/_cygrpc/aio/server.pyx.pxi
_CALL_OVER_FILTER = _CallOverFilter()


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
    logging.getLogger(GRPC_LOGGER).addFilter(_CALL_OVER_FILTER)  # added once: filters are a set
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


def stop_on_signals(grace_s: float, logger: logging.Logger) -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (a graceful stop, not a traceback); a second
    signal only says that the service is already draining."""
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.info("received %s: already draining", sig.name)
            return
        logger.info("received %s: draining for up to %g s", sig.name, grace_s)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop
