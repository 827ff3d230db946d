"""OpenTelemetry for both services and their clients: setup from `OTEL_*`, gRPC instrumentation,
GenAI semantic-convention names, and the few recording helpers the servicers share.

Built once at start by `setup_telemetry(service_name, environ)`; nothing here reads the environment
at import time. Export follows the OTel SDK's variables with one rule on top: nothing is exported
unless asked for.

- traces: `OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`; comma-separated). Unset, it is `otlp`
  when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, else `none`.
- metrics: `OTEL_METRICS_EXPORTER` likewise (`..._METRICS_ENDPOINT`), every
  `OTEL_METRIC_EXPORT_INTERVAL` ms.
- `OTEL_SERVICE_NAME` overrides the service's own name; `OTEL_RESOURCE_ATTRIBUTES` are added;
  `OTEL_SDK_DISABLED=true` turns everything off.
- gRPC health checks are never traced; `OTEL_PYTHON_GRPC_EXCLUDED_SERVICES` excludes more services.

NOTE: off means free. With no exporter configured `Telemetry.is_enabled` is False: no providers, no
interceptors, and the servicers skip recording altogether, so per request they pay a few `is None`
checks and per token nothing. On, the per-request cost is a handful of spans and histogram points;
the engine thread only appends to a request's timeline (`services/decoder/outputs.py`), which the
servicer turns into span events when the request ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import grpc
from google.rpc import code_pb2
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import any_of, health_check, negate
from opentelemetry.instrumentation.grpc.filters import service_name as grpc_service
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common import errors
from common.status import to_status_proto

# -- names ------------------------------------------------------------------------------------------
# GenAI semantic conventions (Development status; open-telemetry/semantic-conventions docs/gen-ai).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_EMBEDDINGS_DIMENSION_COUNT = "gen_ai.embeddings.dimension.count"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"  # "input" | "output", on gen_ai.client.token.usage
ERROR_TYPE = "error.type"
# Tandem's own.
TANDEM_PROMPT_EMBEDDING_POSITIONS = "tandem.prompt.embedding_positions"  # prompt rows sent as embeddings
TANDEM_USAGE_CACHED_TOKENS = "tandem.usage.cached_tokens"  # prompt positions served by the prefix cache
TANDEM_WORLD_SIZE = "tandem.world_size"  # decoder ranks
TANDEM_TOKEN_KIND = "tandem.token.kind"  # on tandem.server.tokens: see TOKEN_KINDS
TANDEM_REQUEST_STATE = "tandem.request.state"  # "running" | "waiting"
TANDEM_KV_BLOCK_STATE = "tandem.kv_block.state"  # "used" | "free"

PROVIDER = "tandem"
OPERATION_TEXT_COMPLETION = "text_completion"
OPERATION_EMBEDDINGS = "embeddings"
TOKEN_KINDS = ("prompt_token", "prompt_embedding", "output")

# Metrics. Durations in seconds; bucket advice from the GenAI metric conventions.
GEN_AI_SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
GEN_AI_SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
GEN_AI_CLIENT_OPERATION_DURATION = "gen_ai.client.operation.duration"
GEN_AI_CLIENT_TOKEN_USAGE = "gen_ai.client.token.usage"
TANDEM_SERVER_TOKENS = "tandem.server.tokens"
TANDEM_SERVER_REJECTED = "tandem.server.requests.rejected"
TANDEM_ENGINE_REQUESTS = "tandem.engine.requests"
TANDEM_ENGINE_KV_BLOCKS = "tandem.engine.kv_cache.blocks"
TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS = "tandem.engine.prefix_cache.query_tokens"
TANDEM_ENGINE_PREFIX_CACHE_HIT_TOKENS = "tandem.engine.prefix_cache.hit_tokens"

DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1 ... 67M

HEALTH_SERVICE = "grpc.health.v1.Health"
_INSTRUMENTATION_SCOPE = "tandem"


# -- settings ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TelemetrySettings:
    """What `OTEL_*` asks for, parsed and checked; building exporters is `setup_telemetry`'s job."""

    service_name: str  # resource service.name
    resource_attributes: Mapping[str, str]  # from OTEL_RESOURCE_ATTRIBUTES (service.name excluded)
    traces_exporters: tuple[str, ...]  # subset of ("otlp", "console"); () = tracing off
    metrics_exporters: tuple[str, ...]  # subset of ("otlp", "console"); () = metrics off
    traces_endpoint: str | None  # OTLP/gRPC endpoint; None = the exporter's default
    metrics_endpoint: str | None
    metric_export_interval_s: float  # how often metric readers push
    excluded_grpc_services: tuple[str, ...]  # never traced, on top of grpc.health.v1.Health

    @classmethod
    def from_environ(cls, default_service_name: str, environ: Mapping[str, str]) -> TelemetrySettings:
        """Raises ValueError naming the variable for an exporter or number it cannot use."""
        resource = _parse_resource_attributes(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
        name = environ.get("OTEL_SERVICE_NAME") or resource.pop("service.name", "") or default_service_name
        resource.pop("service.name", None)
        disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
        traces_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or endpoint
        metrics_endpoint = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or endpoint
        interval_ms = environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")
        try:
            interval_s = float(interval_ms) / 1000
        except ValueError:
            raise ValueError(f"OTEL_METRIC_EXPORT_INTERVAL={interval_ms!r}: expected milliseconds") from None
        if interval_s <= 0:
            raise ValueError(f"OTEL_METRIC_EXPORT_INTERVAL={interval_ms!r}: must be > 0")
        excluded = environ.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "")
        return cls(
            service_name=name,
            resource_attributes=resource,
            traces_exporters=()
            if disabled
            else _exporters("OTEL_TRACES_EXPORTER", environ, traces_endpoint is not None),
            metrics_exporters=()
            if disabled
            else _exporters("OTEL_METRICS_EXPORTER", environ, metrics_endpoint is not None),
            traces_endpoint=traces_endpoint,
            metrics_endpoint=metrics_endpoint,
            metric_export_interval_s=interval_s,
            excluded_grpc_services=tuple(s.strip() for s in excluded.split(",") if s.strip()),
        )


def _exporters(variable: str, environ: Mapping[str, str], has_endpoint: bool) -> tuple[str, ...]:
    raw = environ.get(variable)
    if raw is None or not raw.strip():
        return ("otlp",) if has_endpoint else ()
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in ("otlp", "console", "none")]
    if unknown:
        raise ValueError(f"{variable}={raw!r}: unknown exporter {unknown[0]!r}; use otlp, console or none")
    return tuple(n for n in names if n != "none")


def _parse_resource_attributes(raw: str) -> dict[str, str]:
    attributes = {}
    for pair in raw.split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            attributes[key.strip()] = unquote(value.strip())
    return attributes


# -- the handles a process holds ----------------------------------------------------------------------


class Telemetry:
    """The providers of one process and what is built from them. Passed down, never global."""

    def __init__(
        self,
        service_name: str,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
        excluded_grpc_services: Sequence[str] = (),
    ) -> None:
        self.service_name = service_name
        self.tracer_provider = tracer_provider  # None = tracing off
        self.meter_provider = meter_provider  # None = metrics off
        self.tracer: trace.Tracer = (
            tracer_provider.get_tracer(_INSTRUMENTATION_SCOPE) if tracer_provider else trace.NoOpTracer()
        )
        self.meter: metrics.Meter = (
            meter_provider.get_meter(_INSTRUMENTATION_SCOPE)
            if meter_provider
            else metrics.NoOpMeter(_INSTRUMENTATION_SCOPE)
        )
        excluded = [grpc_service(s) for s in excluded_grpc_services]
        self.rpc_filter = negate(any_of(health_check(), *excluded))  # True = the RPC gets a span

    @property
    def is_tracing(self) -> bool:
        return self.tracer_provider is not None

    @property
    def is_metrics(self) -> bool:
        return self.meter_provider is not None

    @property
    def is_enabled(self) -> bool:
        return self.is_tracing or self.is_metrics

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The gRPC server span (W3C context extracted from metadata); [] with tracing off."""
        if not self.is_tracing:
            return []
        return [aio_server_interceptor(tracer_provider=self.tracer_provider, filter_=self.rpc_filter)]

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """gRPC client spans that inject W3C `traceparent` into metadata; [] with tracing off."""
        if not self.is_tracing:
            return []
        return list(aio_client_interceptors(tracer_provider=self.tracer_provider, filter_=self.rpc_filter))

    def force_flush(self, timeout_ms: int = 10_000) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_ms)
        if self.meter_provider is not None:
            self.meter_provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush and stop exporters (at exit)."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def build_telemetry(
    service_name: str,
    span_processors: Iterable[SpanProcessor] = (),
    metric_readers: Sequence[MetricReader] = (),
    *,
    resource_attributes: Mapping[str, str] | None = None,
    excluded_grpc_services: Sequence[str] = (),
    always_trace: bool = False,
) -> Telemetry:
    """Providers over the given processors and readers (tests pass in-memory ones). Tracing is on when
    there is a processor or `always_trace` (a client that wants trace ids even when exporting nothing)."""
    resource = Resource({**(resource_attributes or {}), "service.name": service_name})
    processors = list(span_processors)
    tracer_provider = None
    if processors or always_trace:
        tracer_provider = TracerProvider(resource=resource)
        for processor in processors:
            tracer_provider.add_span_processor(processor)
    meter_provider = (
        MeterProvider(metric_readers=metric_readers, resource=resource) if metric_readers else None
    )
    return Telemetry(service_name, tracer_provider, meter_provider, excluded_grpc_services)


def setup_telemetry(
    default_service_name: str, environ: Mapping[str, str], *, always_trace: bool = False
) -> Telemetry:
    """Telemetry as `OTEL_*` in `environ` asks (see the module docstring). Call once, at start."""
    settings = TelemetrySettings.from_environ(default_service_name, environ)
    processors: list[SpanProcessor] = []
    for name in settings.traces_exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.traces_endpoint)))
        else:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            processors.append(BatchSpanProcessor(ConsoleSpanExporter()))
    readers: list[MetricReader] = []
    interval_ms = settings.metric_export_interval_s * 1000
    for name in settings.metrics_exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter: Any = OTLPMetricExporter(endpoint=settings.metrics_endpoint)
        else:
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            exporter = ConsoleMetricExporter()
        readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms))
    return build_telemetry(
        settings.service_name,
        processors,
        readers,
        resource_attributes=settings.resource_attributes,
        excluded_grpc_services=settings.excluded_grpc_services,
        always_trace=always_trace,
    )


# -- recording helpers ------------------------------------------------------------------------------


def error_type(exc: BaseException) -> str:
    """`error.type`: the gRPC status name a client sees (`INVALID_ARGUMENT`, `CANCELLED`, ...), or the
    exception's class name for bugs (which the client sees as INTERNAL)."""
    if isinstance(exc, errors.TandemError):
        return code_pb2.Code.Name(to_status_proto(exc).code)
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code().name
    return type(exc).__qualname__


def epoch_ns(monotonic_s: float, now_monotonic_s: float, now_epoch_ns: int) -> int:
    """A time.monotonic() reading as Unix-epoch nanoseconds, given one pair of simultaneous readings."""
    return now_epoch_ns + int((monotonic_s - now_monotonic_s) * 1e9)


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


class ServerOperation:
    """One gen_ai operation being served: its span (when tracing) and its request-duration point.

    The span is a child of the current context (the gRPC server span) but is never made current:
    nothing runs under it in this task, and a context attached inside an async generator can be
    detached from the wrong context when the generator is closed by cancellation.
    """

    __slots__ = ("_metrics", "_start", "attributes", "span", "error_type", "is_accepted")

    def __init__(self, telemetry: Telemetry, metrics_: ServerMetrics, operation: str, model: str) -> None:
        self._metrics = metrics_
        self._start = time.monotonic()
        # Low-cardinality attributes shared by the span and every metric point.
        self.attributes: dict[str, str] = {
            GEN_AI_OPERATION_NAME: operation,
            GEN_AI_PROVIDER_NAME: PROVIDER,
            GEN_AI_REQUEST_MODEL: model,
        }
        self.span: Span | None = (
            telemetry.tracer.start_span(
                f"{operation} {model}", kind=SpanKind.INTERNAL, attributes=self.attributes
            )
            if telemetry.is_tracing
            else None
        )
        self.error_type: str | None = None
        self.is_accepted = False  # set by the servicer once the engine admitted the request

    def set(self, attributes: Mapping[str, Any]) -> None:
        if self.span is not None:
            self.span.set_attributes(attributes)

    def add_timeline(self, timeline: Iterable[tuple[str, float, Mapping[str, int | str]]]) -> None:
        """(name, time.monotonic(), attributes) records become span events; attribute keys get a
        `tandem.` prefix."""
        if self.span is None:
            return
        now_s, now_ns = time.monotonic(), time.time_ns()
        for name, at, attributes in timeline:
            self.span.add_event(
                name,
                {f"tandem.{k}": v for k, v in attributes.items()},
                timestamp=epoch_ns(at, now_s, now_ns),
            )

    def fail(self, exc: BaseException) -> None:
        """Record why the operation failed; a refusal before admission also counts as rejected."""
        if self.error_type is not None:
            return
        self.error_type = error_type(exc)
        if not self.is_accepted and isinstance(exc, errors.TandemError):
            self._metrics.rejected.add(1, {**self.attributes, ERROR_TYPE: self.error_type})
        if self.span is not None:
            self.span.set_attribute(ERROR_TYPE, self.error_type)
            self.span.set_status(Status(StatusCode.ERROR, f"{self.error_type}: {exc}"))

    def end(self) -> None:
        attributes: dict[str, str] = self.attributes
        if self.error_type is not None:
            attributes = {**attributes, ERROR_TYPE: self.error_type}
        self._metrics.request_duration.record(time.monotonic() - self._start, attributes)
        if self.span is not None:
            self.span.end()


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
