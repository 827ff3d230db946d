"""The instruments: the servers' GenAI histograms and counters, and the client's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics

from ..semconv import (
    DURATION_BUCKETS,
    GEN_AI_CLIENT_OPERATION_DURATION,
    GEN_AI_CLIENT_TOKEN_USAGE,
    GEN_AI_SERVER_REQUEST_DURATION,
    GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
    GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
    GEN_AI_TOKEN_TYPE,
    TANDEM_SERVER_REJECTED,
    TANDEM_SERVER_TOKENS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)


class ServerMetrics:
    """The server-side instruments, made once per servicer from the process's meter."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.request_duration = meter.create_histogram(
            GEN_AI_SERVER_REQUEST_DURATION,
            unit="s",
            description="Time a gen_ai request spent in the server, arrival to last response",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.time_to_first_token = meter.create_histogram(
            GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Time from a request's admission to its first sampled token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.time_per_output_token = meter.create_histogram(
            GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Decode time per output token after the first",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.tokens = meter.create_counter(
            TANDEM_SERVER_TOKENS,
            unit="{token}",
            description="Positions of finished requests: prompt tokens, prompt embedding rows, output",
        )
        self.rejected = meter.create_counter(
            TANDEM_SERVER_REJECTED,
            unit="{request}",
            description="Requests refused before admission, by error.type",
        )


class ClientMetrics:
    """The client-side GenAI instruments."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.operation_duration = meter.create_histogram(
            GEN_AI_CLIENT_OPERATION_DURATION,
            unit="s",
            description="GenAI operation duration as the client sees it",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.token_usage = meter.create_histogram(
            GEN_AI_CLIENT_TOKEN_USAGE,
            unit="{token}",
            description="Input and output tokens per operation",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )

    def record(self, attributes: Mapping[str, Any], duration_s: float) -> None:
        self.operation_duration.record(duration_s, attributes)

    def record_usage(
        self, attributes: Mapping[str, Any], input_tokens: int | None, output_tokens: int | None
    ) -> None:
        if input_tokens is not None:
            self.token_usage.record(input_tokens, {**attributes, GEN_AI_TOKEN_TYPE: "input"})
        if output_tokens is not None:
            self.token_usage.record(output_tokens, {**attributes, GEN_AI_TOKEN_TYPE: "output"})
