"""The gauge of decoder replicas left out for their model: what an operator alerts on, since /health
stays "ok" while another replica serves; `tandem serve openai` reports it over several replicas, and
one of encoder replicas over several encoders."""

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
from tandem.gateway.replica_metrics import (
    TANDEM_GATEWAY_ENCODER_REPLICAS_LEFT_OUT,
    TANDEM_GATEWAY_REPLICAS_LEFT_OUT,
    observe_replicas,
)
from tandem.gateway.replicas import Replicas

from .fake_decoder import fake_decoder
from .metric_readings import readings as _readings


@dataclass
class _Counted:
    """What the gauge reads of `Replicas`."""

    num_left_out: int = 0
    kind: str = "decoder"


def test_the_gauge_reads_the_replicas_left_out_at_each_collection() -> None:
    reader = InMemoryMetricReader()
    counted = _Counted()
    observe_replicas(otel.build_telemetry("tandem-openai", [], [reader]).meter, cast(Replicas, counted))
    assert _readings(reader)[TANDEM_GATEWAY_REPLICAS_LEFT_OUT] == 0
    counted.num_left_out = 2
    assert _readings(reader)[TANDEM_GATEWAY_REPLICAS_LEFT_OUT] == 2


async def test_serve_reports_the_gauge_over_several_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = InMemoryMetricReader()
    exported = otel.build_telemetry("tandem-openai", [], [reader])  # as OTEL_METRICS_EXPORTER asks
    monkeypatch.setattr(gateway_main, "setup_telemetry", lambda *_: exported)
    async with fake_decoder() as (_, address):
        replicas = f"{address},127.0.0.1:9"  # the second never answers: watched, not serving
        encoders = "127.0.0.1:9,127.0.0.1:10"  # watched, never serving
        config = GatewayConfig(decoder_address=replicas, encoder_address=encoders, port=0, body_workers=1)
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(gateway_main.serve(config, ready))
        try:
            await asyncio.wait_for(ready, 30)
            readings = _readings(reader)
            assert (
                readings[TANDEM_GATEWAY_REPLICAS_LEFT_OUT]
                == readings[TANDEM_GATEWAY_ENCODER_REPLICAS_LEFT_OUT]
                == 0
            )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
