"""The gateway's unread answers as gauges: the bytes all callers hold, the largest caller's, and the
answers waiting for room; `tandem serve openai` reports them when metrics are exported."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tandem.client import telemetry as otel
from tandem.gateway import __main__ as gateway_main
from tandem.gateway.answer_bytes import AnswerBytes, Reservation
from tandem.gateway.answer_metrics import (
    TANDEM_GATEWAY_UNREAD_ANSWER_BYTES,
    TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES,
    TANDEM_GATEWAY_UNREAD_ANSWERS_WAITING,
    observe_answer_bytes,
)
from tandem.gateway.config import GatewayConfig
from tandem.gateway.connection_metrics import (
    TANDEM_GATEWAY_CONNECTIONS_EVICTED,
    TANDEM_GATEWAY_CONNECTIONS_REFUSED,
)
from tandem.gateway.replica_metrics import TANDEM_GATEWAY_REPLICAS_LEFT_OUT

from .fake_decoder import fake_decoder
from .metric_readings import readings as _readings

NAMES = (
    TANDEM_GATEWAY_UNREAD_ANSWER_BYTES,
    TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES,
    TANDEM_GATEWAY_UNREAD_ANSWERS_WAITING,
)


async def test_the_gauges_read_the_bytes_held_the_largest_callers_and_the_answers_waiting() -> None:
    reader = InMemoryMetricReader()
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=500)
    observe_answer_bytes(otel.build_telemetry("tandem-openai", [], [reader]).meter, held)
    assert _readings(reader) == dict.fromkeys(NAMES, 0)
    a = await held.reserve("a", 450, 5)
    await held.reserve("b", 300, 5)
    waiting = [asyncio.create_task(held.reserve(c, n, 5)) for c, n in (("a", 100), ("c", 400))]
    await asyncio.sleep(0)  # a's over its share, c's over the gateway's bound
    assert _readings(reader) == dict(zip(NAMES, (750, 450, 2), strict=True))
    a.release()  # both fit now
    await asyncio.gather(*waiting)
    assert _readings(reader) == dict(zip(NAMES, (800, 400, 0), strict=True))


class _ChangedBetweenReads(AnswerBytes):
    """Bytes that change each time the gauges read them, as the event loop may change them between any
    two reads of the collecting thread: caller a's 100 bytes taken, then given back, and so on."""

    is_changing = False
    reservation: Reservation | None = None  # caller a's

    def __getattribute__(self, name: str) -> Any:
        get = object.__getattribute__
        if name in ("num_bytes", "per_caller", "waiters") and not get(self, "is_changing"):
            self.is_changing = True
            reservation = get(self, "reservation")
            reservation.take(-100 if reservation.num_held else 100)
            self.is_changing = False
        return get(self, name)


def test_one_collection_never_shows_the_largest_caller_over_all_callers_whatever_changes_between() -> None:
    """Each gauge's callback reads at its own moment: read apart, a collection showed the largest
    caller's bytes over all callers' (4 in 67,527 collections of a thread against the event loop)."""
    reader = InMemoryMetricReader()
    held = _ChangedBetweenReads(max_bytes=1000, max_bytes_per_caller=500)
    held.reservation = Reservation(held, "a")
    observe_answer_bytes(otel.build_telemetry("tandem-openai", [], [reader]).meter, held)
    seen = [_readings(reader) for _ in range(6)]
    bytes_, largest = TANDEM_GATEWAY_UNREAD_ANSWER_BYTES, TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES
    assert [r for r in seen if r[largest] > r[bytes_]] == []
    assert {r[bytes_] for r in seen} <= {0, 100}  # each a state the bytes were in


async def test_serve_reports_the_gauges_when_metrics_are_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = InMemoryMetricReader()
    exported = otel.build_telemetry("tandem-openai", [], [reader])  # as OTEL_METRICS_EXPORTER asks
    monkeypatch.setattr(gateway_main, "setup_telemetry", lambda *_: exported)
    async with fake_decoder() as (_, address):
        config = GatewayConfig(decoder_address=address, encoder_address="127.0.0.1:9", port=0, body_workers=1)
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(gateway_main.serve(config, ready))
        try:
            await asyncio.wait_for(ready, 30)
            # One decoder address is a replica watched, its gauge of those left out beside them, and the
            # counters of connections at --max-connections.
            others = (
                TANDEM_GATEWAY_REPLICAS_LEFT_OUT,
                TANDEM_GATEWAY_CONNECTIONS_EVICTED,
                TANDEM_GATEWAY_CONNECTIONS_REFUSED,
            )
            assert _readings(reader) == dict.fromkeys((*NAMES, *others), 0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
