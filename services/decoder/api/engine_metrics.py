"""The decoder engine's gauges and counters, read from its scheduler and KV block manager at collection."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics

from common.semconv import (
    TANDEM_ENGINE_KV_BLOCKS,
    TANDEM_ENGINE_PREFIX_CACHE_HIT_TOKENS,
    TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS,
    TANDEM_ENGINE_REQUESTS,
    TANDEM_KV_BLOCK_STATE,
    TANDEM_REQUEST_STATE,
)


def observe_engine(meter: metrics.Meter, engine: Callable[[], Any]) -> None:
    """Observable instruments over a decoder engine's scheduler and KV block manager, read at collection
    time. `engine()` returns the engine or None while it loads. The reads are of ints and container
    lengths, atomic under the GIL, so the engine lock is not taken: a reading may be a step old."""

    def requests(_: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        current = engine()
        if current is None:
            return []
        scheduler = current.core.scheduler
        return [
            metrics.Observation(scheduler.num_running, {TANDEM_REQUEST_STATE: "running"}),
            metrics.Observation(scheduler.num_waiting, {TANDEM_REQUEST_STATE: "waiting"}),
        ]

    def blocks(_: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        current = engine()
        if current is None:
            return []
        manager = current.core.block_manager
        free = manager.num_free_blocks
        return [
            metrics.Observation(manager.num_total_blocks - free, {TANDEM_KV_BLOCK_STATE: "used"}),
            metrics.Observation(free, {TANDEM_KV_BLOCK_STATE: "free"}),
        ]

    def prefix_counter(attribute: str) -> Callable[[metrics.CallbackOptions], Iterable[metrics.Observation]]:
        def callback(_: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
            current = engine()
            return (
                []
                if current is None
                else [metrics.Observation(getattr(current.core.block_manager, attribute))]
            )

        return callback

    meter.create_observable_gauge(
        TANDEM_ENGINE_REQUESTS, [requests], unit="{request}", description="Requests running and waiting"
    )
    meter.create_observable_gauge(
        TANDEM_ENGINE_KV_BLOCKS, [blocks], unit="{block}", description="KV cache blocks used and free"
    )
    meter.create_observable_counter(
        TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS,
        [prefix_counter("num_prefix_queries_tokens")],
        unit="{token}",
        description="Prompt positions looked up in the prefix cache at admission",
    )
    meter.create_observable_counter(
        TANDEM_ENGINE_PREFIX_CACHE_HIT_TOKENS,
        [prefix_counter("num_prefix_hits_tokens")],
        unit="{token}",
        description="Prompt positions served from the prefix cache",
    )
