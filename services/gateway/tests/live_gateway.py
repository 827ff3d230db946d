"""The gateway's app served on a free loopback port in front of a decoder (the tests' fake), as
`tandem serve openai` serves it (handler cancellation, its server log and its access log on, its
connections through the ConnectionGuard, aiohttp's own answers in OpenAI's shape, its keep-alive
timeout the idle timeout), with one body worker process, started only by a body over large_body_bytes.
Always shut down."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from tandem.gateway.access_log import AccessLog
from tandem.gateway.app import FIRST_HEALTH_S, Gateway
from tandem.gateway.bodies import BodyWorkers
from tandem.gateway.callers import decoder_channels
from tandem.gateway.config import GatewayConfig
from tandem.gateway.connections import LINGERING_S, ConnectionGuard, OpenAIRequestHandler, ServerLog
from tandem.gateway.encoders import gateway_encoder


@contextlib.asynccontextmanager
async def live_gateway(
    decoder_address: str,
    send_buffer_bytes: int | None = None,
    lingering_s: float = LINGERING_S,
    tracer: Any = None,
    first_health_s: float = FIRST_HEALTH_S,
    **settings: Any,
) -> AsyncIterator[str]:
    """The gateway's base URL (http://127.0.0.1:PORT/v1), with `settings` over GatewayConfig's defaults
    (its encoder an address where none listens, unless `settings` name one), its encoder the one
    `tandem serve openai` builds (`gateway_encoder`). With `send_buffer_bytes`, each connection's kernel
    send buffer is that small and stays so (Linux: an accepted socket takes its listener's), as over a
    slow network: loopback grows it to MiBs, which an unread answer of a few tens of KiB never fills.
    `tracer`: the gateway's, when a test traces it. `first_health_s`: how long its start waits for a
    decoder replica to serve (0 where a test's decoder never will: it waited 1 s)."""
    settings = {"encoder_address": "127.0.0.1:9"} | settings
    config = GatewayConfig(decoder_address=decoder_address, port=0, **settings)
    encoder = gateway_encoder(config)
    callers = decoder_channels(config)
    workers = BodyWorkers(1)  # started by the first body over large_body_bytes, if any (a second)
    gateway = Gateway(config, encoder, callers, workers, tracer=tracer, first_health_s=first_health_s)
    handler_settings: dict[str, Any] = {
        "keepalive_timeout": config.idle_timeout_s,
        "lingering_time": lingering_s,  # LINGERING_S as `tandem serve openai` (aiohttp's default is 10 s)
        "logger": ServerLog(),
        "access_log_class": AccessLog,
    }
    # Open streams get --grace-s at shutdown, as `tandem serve openai` gives them.
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
    listener = await loop.create_server(gateway.guard, "127.0.0.1", 0)
    if send_buffer_bytes is not None:
        listener.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        listener.close()
        await runner.cleanup()
        await gateway.close()
        await callers.close()
        workers.close()
        await encoder.close()
