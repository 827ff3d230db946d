"""The counters of connections closed and refused at --max-connections: counted for tests alone, an
operator saw nothing of a gateway at its bound closing its callers' keep-alive connections; `tandem
serve openai` reports them."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import cast

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tandem.client import telemetry as otel
from tandem.gateway import __main__ as gateway_main
from tandem.gateway.config import GatewayConfig
from tandem.gateway.connection_metrics import (
    TANDEM_GATEWAY_CONNECTIONS_EVICTED,
    TANDEM_GATEWAY_CONNECTIONS_REFUSED,
    observe_connections,
)
from tandem.gateway.connections import ConnectionGuard

from .fake_decoder import fake_decoder
from .metric_readings import readings as _readings
from .raw_http import COMPLETIONS_HEAD, connect, read_to_close


@dataclass
class _Counted:
    """What the counters read of `ConnectionGuard`."""

    num_evicted: int = 0
    num_refused: int = 0


def test_the_counters_read_the_connections_closed_and_refused_at_each_collection() -> None:
    reader = InMemoryMetricReader()
    counted = _Counted()
    observe_connections(
        otel.build_telemetry("tandem-openai", [], [reader]).meter, cast(ConnectionGuard, counted)
    )
    readings = _readings(reader)
    assert (readings[TANDEM_GATEWAY_CONNECTIONS_EVICTED], readings[TANDEM_GATEWAY_CONNECTIONS_REFUSED]) == (
        0,
        0,
    )
    counted.num_evicted, counted.num_refused = 3, 2
    readings = _readings(reader)
    assert (readings[TANDEM_GATEWAY_CONNECTIONS_EVICTED], readings[TANDEM_GATEWAY_CONNECTIONS_REFUSED]) == (
        3,
        2,
    )


async def test_serve_reports_the_connections_closed_and_refused_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader = InMemoryMetricReader()
    exported = otel.build_telemetry("tandem-openai", [], [reader])  # as OTEL_METRICS_EXPORTER asks
    monkeypatch.setattr(gateway_main, "setup_telemetry", lambda *_: exported)
    async with fake_decoder() as (_, address):
        config = GatewayConfig(decoder_address=address, port=0, body_workers=1, max_connections=1)
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(gateway_main.serve(config, ready))
        socks = []
        try:
            url = f"http://127.0.0.1:{await asyncio.wait_for(ready, 30)}/v1"
            socks.append(await connect(url, host="127.0.0.9"))  # sends nothing: waits
            socks.append(await connect(url, host="127.0.0.10"))  # closes the first for its place
            # Its request's body not sent: its handler reads it, and no connection waits.
            await asyncio.get_running_loop().sock_sendall(
                socks[-1], COMPLETIONS_HEAD + b"Content-Length: 9\r\n\r\n"
            )
            await asyncio.sleep(0.1)
            socks.append(await connect(url, host="127.0.0.11"))
            refused = await read_to_close(socks[-1], 5)
            readings = _readings(reader)
        finally:
            for sock in socks:
                sock.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert refused.startswith(b"HTTP/1.1 503")
    assert (readings[TANDEM_GATEWAY_CONNECTIONS_EVICTED], readings[TANDEM_GATEWAY_CONNECTIONS_REFUSED]) == (
        1,
        1,
    )
