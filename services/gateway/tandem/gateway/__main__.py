"""`tandem serve openai`: the OpenAI-compatible HTTP gateway in front of a decoder and an encoder.

Every flag can also come from a `TANDEM_OPENAI_<FLAG>` variable. The gateway holds no model: it
listens within a second (its start waits up to FIRST_HEALTH_S for a decoder replica's health, so a
request just after it is not refused for the watch not having heard yet), and its /health answers 503
until a decoder replica serves. Exit codes: 0 after SIGTERM or
SIGINT, 2 for a flag or variable that is wrong (a port in use included, or a host the listen refuses);
every failure is one line.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
from typing import Any

import click
from aiohttp import web

from tandem.client.auth import load_tokens
from tandem.client.channel import ChannelSecurity
from tandem.client.errors import ConfigError
from tandem.client.telemetry import setup_telemetry
from tandem.common.client_security_flags import client_security
from tandem.common.flags import (
    CONTEXT_SETTINGS,
    PATH,
    Setting,
    default_of,
    flag_error,
    run,
)
from tandem.common.listening import PORT_TRIES, asyncio_plan, check_port_free, free_port_of
from tandem.common.startup_heap import freeze_startup_heap, thaw_startup_heap
from tandem.common.stop_signals import stop_on_signals
from tandem.gateway.access_log import AccessLog
from tandem.gateway.answer_metrics import observe_answer_bytes
from tandem.gateway.app import FIRST_HEALTH_S, Gateway
from tandem.gateway.bodies import BodyWorkers
from tandem.gateway.callers import decoder_channels, model_check_metadata
from tandem.gateway.config import DEFAULT_PORT, GatewayConfig
from tandem.gateway.connection_metrics import observe_connections
from tandem.gateway.connections import (
    LINGERING_S,
    ConnectionGuard,
    OpenAIRequestHandler,
    ServerLog,
    ensure_descriptors,
)
from tandem.gateway.encoders import EncoderReplicas, gateway_encoder
from tandem.gateway.replica_metrics import TANDEM_GATEWAY_ENCODER_REPLICAS_LEFT_OUT, observe_replicas

log = logging.getLogger("tandem.gateway")
PROG = "tandem serve openai"
ENV_PREFIX = "TANDEM_OPENAI_"


def _setting(flag: str, help: str, **kwargs: Any) -> Setting:
    name = flag.removeprefix("--").replace("-", "_")
    if "default" not in kwargs:
        kwargs["default"] = default_of(GatewayConfig, name)
    return Setting(ENV_PREFIX, flag, help, **kwargs)


def settings() -> list[click.Option]:
    upstream = (
        ("--upstream-tls", "towards the services: use TLS (implied by --upstream-tls-ca)"),
        ("--upstream-tls-ca", "towards the services: the CA to trust (PEM)"),
        ("--upstream-tls-cert", "towards the services: mutual TLS client certificate (PEM)"),
        ("--upstream-tls-key", "towards the services: its private key (PEM)"),
        ("--upstream-auth-token-file", "towards the services: a token of their own (else the caller's)"),
    )
    return [
        _setting("--host", "listen address (0.0.0.0 in containers)"),
        _setting("--port", "listen port (0 = any free port)", type=int, default=DEFAULT_PORT),
        _setting(
            "--decoder-address",
            "the decoder: host:port, several host:port,..., or a DNS name whose addresses are the "
            "replicas, dns:///name:port or dns:name:port (no port: 443; dns://server/... is refused: "
            "names are looked up with the system's resolver)",
        ),
        _setting(
            "--encoder-address",
            "the encoder, for /v1/embeddings (and a chat's pictures where the decoder fetches none): "
            "host:port, several host:port,... or a DNS name, as --decoder-address; several are "
            "watched and one of another model than most gets no calls",
        ),
        _setting(
            "--auth-token-file",
            "accepted bearer tokens, one per line (the services' file); passed on with each call",
            type=PATH,
            default=None,
            show_default="none, no authentication",
        ),
        _setting("--max-body-bytes", "largest request body (embedding rows travel as base64)", type=int),
        _setting(
            "--max-streams-per-caller",
            "open completion streams per caller (its bearer token, else its IP address), one per choice",
            type=int,
        ),
        _setting(
            "--max-choices",
            "choices of one completion request: its prompts x n, each a Generate stream (400 beyond)",
            type=int,
        ),
        _setting("--max-message-bytes", "the services' --max-message-bytes", type=int),
        _setting(
            "--max-embeddings-bytes",
            "largest /v1/embeddings answer, reckoned from rows x width x inputs before any work",
            type=int,
        ),
        _setting(
            "--max-large-bodies",
            "bodies over 1 MiB read, converted or answered at once (503 beyond)",
            type=int,
        ),
        _setting(
            "--max-large-bodies-per-caller",
            "of those, one caller's (its bearer token, else its IP address; 429 beyond)",
            type=int,
            show_default="2, or --max-large-bodies where that is smaller",
        ),
        _setting(
            "--max-unread-answer-bytes",
            "JSON of non-streamed answers being written, all callers together (waits, then 503)",
            type=int,
        ),
        _setting(
            "--max-unread-answer-bytes-per-caller",
            "of those, one caller's (an answer beyond waits --write-timeout-s, then 429)",
            type=int,
            show_default="a third of --max-unread-answer-bytes",
        ),
        _setting(
            "--body-workers",
            "processes that parse and convert bodies over 1 MiB (at most --max-large-bodies, and the CPUs)",
            type=int,
            show_default="2, or --max-large-bodies where that is smaller",
        ),
        _setting(
            "--max-connections",
            "open HTTP connections (a new one beyond: an idle one closed for it, else 503)",
            type=int,
        ),
        _setting(
            "--header-timeout-s", "a new connection's first request head must arrive within", type=float
        ),
        _setting(
            "--idle-timeout-s",
            "a keep-alive connection idle (or trickling its next head) this long is closed",
            type=float,
        ),
        _setting(
            "--body-idle-timeout-s",
            "a request body sending nothing this long is cut (408, the connection closed)",
            type=float,
        ),
        _setting("--body-timeout-s", "a request body must arrive whole within (408 beyond)", type=float),
        _setting(
            "--write-timeout-s",
            "a caller taking none of its answer this long is closed, its decoder calls cancelled",
            type=float,
        ),
        _setting(
            "--grace-s",
            "on SIGTERM, open streams get this long to finish (the services' --grace-s)",
            type=float,
        ),
        *(
            Setting(
                ENV_PREFIX,
                flag,
                text,
                type=PATH if "tls-c" in flag or "tls-k" in flag or "token" in flag else None,
                is_flag=flag == "--upstream-tls",
                default=False if flag == "--upstream-tls" else None,
                show_default="off" if flag == "--upstream-tls" else "none",
            )
            for flag, text in upstream
        ),
    ]


def command() -> click.Command:
    return click.Command(
        "openai",
        params=settings(),
        callback=_start,
        help="Serve the OpenAI HTTP API (/v1/chat/completions, /v1/completions, /v1/embeddings, "
        "/v1/models) in front of a running decoder and encoder.",
        context_settings=CONTEXT_SETTINGS,
    )


def main(argv: list[str] | None = None) -> int:
    return run(command(), argv, PROG)


def config_from_args(argv: list[str]) -> GatewayConfig:
    """The config `tandem serve openai ARGV` runs: flags, then TANDEM_OPENAI_* variables, then
    defaults (`tandem up` checks its gateway's with it before starting anything). Raises
    click.UsageError for a value that does not parse, ConfigError for one refused."""
    with command().make_context(PROG, list(argv)) as ctx:
        return config_from_options(ctx.params)


def config_from_options(values: dict[str, Any]) -> GatewayConfig:
    tokens = None
    if values["auth_token_file"] is not None:
        try:
            tokens = load_tokens(values["auth_token_file"])
        except ValueError as error:
            raise ConfigError("auth_token_file", f": {error}") from None
    return GatewayConfig(
        decoder_address=values["decoder_address"],
        encoder_address=values["encoder_address"],
        host=values["host"],
        port=values["port"],
        auth_tokens=tokens,
        upstream=upstream_security(values),
        max_body_bytes=values["max_body_bytes"],
        max_streams_per_caller=values["max_streams_per_caller"],
        max_choices=values["max_choices"],
        max_message_bytes=values["max_message_bytes"],
        max_embeddings_bytes=values["max_embeddings_bytes"],
        max_large_bodies=values["max_large_bodies"],
        max_large_bodies_per_caller=values["max_large_bodies_per_caller"],
        max_unread_answer_bytes=values["max_unread_answer_bytes"],
        max_unread_answer_bytes_per_caller=values["max_unread_answer_bytes_per_caller"],
        body_workers=values["body_workers"],
        max_connections=values["max_connections"],
        header_timeout_s=values["header_timeout_s"],
        idle_timeout_s=values["idle_timeout_s"],
        body_idle_timeout_s=values["body_idle_timeout_s"],
        body_timeout_s=values["body_timeout_s"],
        write_timeout_s=values["write_timeout_s"],
        grace_s=values["grace_s"],
    )


def upstream_security(values: dict[str, Any]) -> ChannelSecurity:
    """The TLS and token towards the services, read as every client's are (`client_security`). Raises
    ConfigError naming the --upstream-* flag at fault: every refusal was once said of --upstream-tls-ca,
    a token file not found and a certificate without its key included."""
    return client_security(values, prefix="upstream_")


def _start(**values: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = click.get_current_context()
    try:
        config = config_from_options(values)
        check_port_free(config.host, config.port, asyncio_plan(config.host))  # asyncio binds it
        ensure_descriptors(config.max_connections, config.max_idle_channels)
    except ConfigError as error:
        raise flag_error(ctx.command, error) from None
    try:
        asyncio.run(serve(config))
    except ConfigError as error:  # the host and port, refused by the listen itself
        raise flag_error(ctx.command, error) from None
    return 0


async def serve(
    config: GatewayConfig, ready: asyncio.Future[int] | None = None, first_health_s: float = FIRST_HEALTH_S
) -> None:
    """Listen until a signal (or until cancelled); `ready` gets the port once listening. The start
    waits up to `first_health_s` for a decoder replica to serve (`Gateway`; tests set less)."""
    telemetry = setup_telemetry("tandem-openai", os.environ)
    encoder = gateway_encoder(config, telemetry, model_check_metadata(config))  # its replicas checked
    callers = decoder_channels(config, telemetry.client_interceptors())
    workers = BodyWorkers(config.body_workers)
    tracer = telemetry.tracer if telemetry.is_tracing else None
    # Open streams get the services' grace period on SIGTERM (aiohttp's default is 60 s; compose and
    # Kubernetes kill 15 s after the grace period). aiohttp's keep-alive timeout is the idle timeout;
    # lingering (reading what is left of a refused body before closing) is cut to a second. The access
    # log leaves out the health probes that succeed (access_log.py).
    # aiohttp's own answers (a request it cannot parse) are in OpenAI's error shape (OpenAIRequestHandler).
    gateway = Gateway(config, encoder, callers, workers, tracer=tracer, first_health_s=first_health_s)
    if telemetry.is_metrics:
        observe_answer_bytes(telemetry.meter, gateway.answer_bytes)
        observe_replicas(telemetry.meter, callers.replicas)
        if isinstance(encoder, EncoderReplicas):
            observe_replicas(telemetry.meter, encoder.replicas, TANDEM_GATEWAY_ENCODER_REPLICAS_LEFT_OUT)
    handler_settings: dict[str, Any] = {
        "keepalive_timeout": config.idle_timeout_s,
        "lingering_time": LINGERING_S,
        "logger": ServerLog(),
        "access_log_class": AccessLog,
    }
    runner = web.AppRunner(
        gateway.app(), handler_cancellation=True, shutdown_timeout=config.grace_s, **handler_settings
    )
    await runner.setup()
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    handlers = functools.partial(OpenAIRequestHandler, runner.server, loop=loop, **handler_settings)
    gateway.guard = ConnectionGuard(
        handlers, config.max_connections, config.header_timeout_s, config.write_timeout_s
    )
    if telemetry.is_metrics:
        observe_connections(telemetry.meter, gateway.guard)
    own_process = ready is None  # (tests run it on their loop, in their process)
    if own_process:  # its start-up heap out of the collector's full passes, before anything is served
        freeze_startup_heap()
    listener: asyncio.Server | None = None
    try:
        listener = await listen(gateway.guard, config.host, config.port)
        port = listener.sockets[0].getsockname()[1]
        await workers.start()
        log.info(
            "serving the OpenAI API on %s:%d (decoder %s, encoder %s)",
            config.host,
            port,
            config.decoder_address,
            config.encoder_address,
        )
        if ready is not None:
            ready.set_result(port)
        if own_process:
            await stop_on_signals(config.grace_s, log).wait()
        else:
            await asyncio.Event().wait()  # until cancelled (tests)
    finally:
        if own_process:
            thaw_startup_heap()
        if listener is not None:
            listener.close()
        await runner.cleanup()
        await gateway.close()
        await callers.close()
        workers.close()
        await encoder.close()
        telemetry.shutdown()


async def listen(guard: ConnectionGuard, host: str, port: int) -> asyncio.Server:
    """The listening socket. Raises ConfigError naming the port (taken since `check_port_free` saw it
    free) or the host: the check cannot see all the bind refuses (a name that stopped resolving, an
    address of another host with --port 0), which was an OSError traceback after the flags passed.
    Port 0 on a name of several addresses is one port free on each: asyncio binds each address on a
    kernel's pick of its own, and the port said was the first socket's alone; where another process
    takes that port at one of them before the bind (asyncio binds all or none), another is picked."""
    for _ in range(PORT_TRIES):
        picked = port or free_port_of(asyncio_plan(host))
        try:
            return await asyncio.get_running_loop().create_server(guard, host, picked)
        except OSError as error:
            if error.errno == errno.EADDRINUSE and picked != port:
                continue
            field = "port" if error.errno in (errno.EADDRINUSE, errno.EACCES) else "host"
            raise ConfigError(
                field, f": cannot listen on {host}:{picked}: {error.strerror or error}"
            ) from None
    raise ConfigError("port", f": cannot listen on {host}:0: another process took each port picked")


if __name__ == "__main__":
    raise SystemExit(main())
