"""The decoder engine's gauges and counters, read from its scheduler and KV block manager at collection.

The reads are of ints and container lengths, atomic under the GIL, so the engine lock is not taken:
a reading may be a step old. While the engine loads there is nothing to read, and nothing is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics

from tandem.client.semconv import (
    TANDEM_ENGINE_KV_BLOCKS,
    TANDEM_ENGINE_PREFIX_CACHE_HIT_TOKENS,
    TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS,
    TANDEM_ENGINE_REQUESTS,
    TANDEM_ENGINE_SPECULATIVE_ACCEPTED_TOKENS,
    TANDEM_ENGINE_SPECULATIVE_PROPOSED_TOKENS,
    TANDEM_KV_BLOCK_STATE,
    TANDEM_REQUEST_STATE,
)
from tandem.decoder.engine.front.engine import Engine

Readings = Iterable[metrics.Observation]


class EngineReadings:
    """One callback per instrument over `engine()`, which is the engine or None while it loads."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self.engine = engine

    def requests(self, _: metrics.CallbackOptions) -> Readings:
        current = self.engine()
        if current is None:
            return []
        scheduler = current.core.scheduler
        return [
            metrics.Observation(scheduler.num_running, {TANDEM_REQUEST_STATE: "running"}),
            metrics.Observation(scheduler.num_waiting, {TANDEM_REQUEST_STATE: "waiting"}),
            metrics.Observation(scheduler.num_paused, {TANDEM_REQUEST_STATE: "paused"}),
        ]

    def blocks(self, _: metrics.CallbackOptions) -> Readings:
        current = self.engine()
        if current is None:
            return []
        manager = current.core.block_manager
        free = manager.num_free_blocks
        return [
            metrics.Observation(manager.num_total_blocks - free, {TANDEM_KV_BLOCK_STATE: "used"}),
            metrics.Observation(free, {TANDEM_KV_BLOCK_STATE: "free"}),
        ]

    def prefix_query_tokens(self, _: metrics.CallbackOptions) -> Readings:
        current = self.engine()
        return (
            []
            if current is None
            else [metrics.Observation(current.core.block_manager.num_prefix_queries_tokens)]
        )

    def prefix_hit_tokens(self, _: metrics.CallbackOptions) -> Readings:
        current = self.engine()
        return (
            []
            if current is None
            else [metrics.Observation(current.core.block_manager.num_prefix_hits_tokens)]
        )

    def proposed_tokens(self, _: metrics.CallbackOptions) -> Readings:
        current = self.engine()
        return [] if current is None else [metrics.Observation(current.core.num_proposed_tokens)]

    def accepted_tokens(self, _: metrics.CallbackOptions) -> Readings:
        current = self.engine()
        return [] if current is None else [metrics.Observation(current.core.num_accepted_tokens)]


def observe_engine(meter: metrics.Meter, engine: Callable[[], Engine | None]) -> None:
    """Observable instruments over a decoder engine, read at collection time."""
    readings = EngineReadings(engine)
    meter.create_observable_gauge(
        TANDEM_ENGINE_REQUESTS,
        [readings.requests],
        unit="{request}",
        description="Requests running and waiting",
    )
    meter.create_observable_gauge(
        TANDEM_ENGINE_KV_BLOCKS,
        [readings.blocks],
        unit="{block}",
        description="KV cache blocks used and free",
    )
    meter.create_observable_counter(
        TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS,
        [readings.prefix_query_tokens],
        unit="{token}",
        description="Prompt positions looked up in the prefix cache at admission",
    )
    meter.create_observable_counter(
        TANDEM_ENGINE_PREFIX_CACHE_HIT_TOKENS,
        [readings.prefix_hit_tokens],
        unit="{token}",
        description="Prompt positions served from the prefix cache",
    )
    meter.create_observable_counter(
        TANDEM_ENGINE_SPECULATIVE_PROPOSED_TOKENS,
        [readings.proposed_tokens],
        unit="{token}",
        description="Speculative decoding: proposed tokens verified",
    )
    meter.create_observable_counter(
        TANDEM_ENGINE_SPECULATIVE_ACCEPTED_TOKENS,
        [readings.accepted_tokens],
        unit="{token}",
        description="Speculative decoding: proposed tokens accepted (each an engine step saved)",
    )
