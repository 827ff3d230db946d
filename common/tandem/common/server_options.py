"""The transport settings both services' servers share (`ServerOptions`), their defaults and the
bounds gRPC's C ints put on them, checked when built: each refusal is one ConfigError naming its field."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from tandem.client.channel import DEFAULT_MAX_MESSAGE_BYTES
from tandem.client.errors import ConfigError
from tandem.common.server_tls import TlsOptions

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
# Ten minutes: a reconnect (and a Watch asked again) costs a round trip or two, and a client refused
# its Watch by someone who held the places for a moment gets health-based routing back within it.
DEFAULT_MAX_CONNECTION_AGE_S = 600.0
INT32_MAX = 2**31 - 1  # gRPC's "never" for a duration in ms
# The connection ages gRPC can take: one millisecond to its int32 of milliseconds (about 24.8 days).
MIN_CONNECTION_AGE_S = 0.001
MAX_CONNECTION_AGE_S = INT32_MAX / 1000


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
        if not 1024 <= self.max_message_bytes <= INT32_MAX:
            raise ConfigError(
                "max_message_bytes",
                f"must be in 1024..{INT32_MAX} (gRPC's int), got {self.max_message_bytes}",
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
