"""The process's tracer and meter providers, built from settings, and the gRPC interceptors over them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import __version__ as _grpc_instrumentation_version
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.instrumentation.grpc.filters import any_of, health_check, negate
from opentelemetry.instrumentation.grpc.filters import service_name as grpc_service
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .propagation import install_propagator
from .server_spans import ServerSpans
from .settings import TelemetrySettings

_INSTRUMENTATION_SCOPE = "tandem"
# The exporter retries the codes it is given (an empty set means its default ones); a failed export
# never ends OK, so with this set nothing is retried.
_NO_RETRIES = (grpc.StatusCode.OK,)
# Every string attribute of a span (and each string of a list) is cut to this many characters; an
# event's are not (an exception's stacktrace ends with the frame that raised it and its message, which
# a cut at the front loses; OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT still bounds them). Attributes hold
# what callers sent (stop strings, tool names, paths); a 16 MB span, one request's stop strings, had
# put the exporter's batch past the collector's 4 MiB and lost its neighbours' spans, and spans queued
# for a hung collector are bounded by count, not bytes (RSS 306 -> 684 MB for 20 such requests).
MAX_ATTRIBUTE_CHARS = 1024
# A service's exports at exit, all together, wait at most this long (or the export timeout, if
# shorter): deploy/ and docker-compose allow 15 s past --grace-s before the kill, and a hung collector
# had held an idle encoder's exit 31.7 s, the gateway's 20.5 s.
MAX_SERVICE_SHUTDOWN_S = 5.0
# Loggers that echo a caller's header at WARNING, once per request (an invalid tracestate, up to 8 KB
# a line): the header is dropped as the spec says, and the log keeps only errors.
# "opentelemetry.attributes" warns once for each attribute MAX_ATTRIBUTE_CHARS cuts, which a caller chooses.
_CALLER_ECHOING_LOGGERS = (
    "opentelemetry.trace.span",
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.attributes",
)


class Telemetry:
    """The providers of one process and what is built from them. Passed down, never global."""

    def __init__(
        self,
        service_name: str,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
        excluded_grpc_services: Sequence[str] = (),
        is_exporting_traces: bool | None = None,
        shutdown_timeout_s: float | None = None,
    ) -> None:
        self.service_name = service_name
        self.tracer_provider = tracer_provider  # None = tracing off
        self.meter_provider = meter_provider  # None = metrics off
        # Spans go somewhere; False for a provider that only makes trace ids (`always_trace`).
        self.is_exporting_traces = (
            tracer_provider is not None if is_exporting_traces is None else is_exporting_traces
        )
        self.shutdown_timeout_s = shutdown_timeout_s  # bounds `shutdown`; None: it waits for the exports
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
        """The gRPC server span (server_spans.py), under the instrumentation's scope as it was made
        there, so that its consumers see no change; [] with tracing off."""
        if not self.is_tracing:
            return []
        tracer = trace.get_tracer(
            "opentelemetry.instrumentation.grpc",
            _grpc_instrumentation_version,
            self.tracer_provider,
            schema_url="https://opentelemetry.io/schemas/1.11.0",
        )
        return [ServerSpans(tracer, self.rpc_filter)]

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
        """Flush and stop exporters (at exit). With `shutdown_timeout_s`, the tracer's and the meter's
        last exports run side by side and this returns after that long at most, whatever is left
        (their threads are daemons: a process exiting then drops what they still hold)."""
        providers = [p for p in (self.tracer_provider, self.meter_provider) if p is not None]
        timeout_s = self.shutdown_timeout_s
        if timeout_s is None:
            for provider in providers:
                provider.shutdown()
            return
        threads = [
            threading.Thread(target=p.shutdown, name="telemetry-shutdown", daemon=True) for p in providers
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def build_telemetry(
    service_name: str,
    span_processors: Iterable[SpanProcessor] = (),
    metric_readers: Sequence[MetricReader] = (),
    *,
    resource_attributes: Mapping[str, str] | None = None,
    excluded_grpc_services: Sequence[str] = (),
    always_trace: bool = False,
    shutdown_on_exit: bool = True,
    shutdown_timeout_s: float | None = None,
    sets_propagator: bool = True,
) -> Telemetry:
    """Providers over the given processors and readers (tests pass in-memory ones). Tracing is on when
    there is a processor or `always_trace` (a client that wants trace ids even when exporting nothing).
    `shutdown_on_exit`: the SDK shuts the providers down at exit (False: the caller does, once);
    `shutdown_timeout_s` bounds `Telemetry.shutdown`; `sets_propagator`: tracing makes
    BoundedTraceContext the process's propagator (False: the process's own stays)."""
    resource = Resource({**(resource_attributes or {}), "service.name": service_name})
    processors = list(span_processors)
    tracer_provider = None
    if processors or always_trace:
        tracer_provider = TracerProvider(
            resource=resource,
            shutdown_on_exit=shutdown_on_exit,
            span_limits=SpanLimits(max_span_attribute_length=MAX_ATTRIBUTE_CHARS),
        )
        if sets_propagator:
            install_propagator()
        for processor in processors:
            tracer_provider.add_span_processor(processor)
    meter_provider = (
        MeterProvider(metric_readers=metric_readers, resource=resource, shutdown_on_exit=shutdown_on_exit)
        if metric_readers
        else None
    )
    return Telemetry(
        service_name,
        tracer_provider,
        meter_provider,
        excluded_grpc_services,
        is_exporting_traces=bool(processors),
        shutdown_timeout_s=shutdown_timeout_s,
    )


def setup_telemetry(
    default_service_name: str,
    environ: Mapping[str, str],
    *,
    always_trace: bool = False,
    is_one_shot: bool = False,
    owns_process: bool = True,
) -> Telemetry:
    """Telemetry as `OTEL_*` in `environ` asks (see the module docstring). Call once, at start.

    `owns_process`: a service or command, whose propagator becomes BoundedTraceContext (propagation.py)
    unless OTEL_PROPAGATORS names another; False for the client library inside someone's application,
    whose process-wide propagator is its own.

    `is_one_shot`: a command that makes its calls and exits (`tandem generate`). Its exports are tried
    once, not retried with backoff (a collector that refused a moment ago will not take the spans a
    second later, and a command would wait for it), each bounded by OTEL_EXPORTER_OTLP_TIMEOUT, and
    `shutdown` bounds them all together by that timeout: an unreachable collector costs it the
    timeout once, not 16 s of retries. It then shuts its providers down itself. A service's `shutdown`
    is bounded too, by the timeout or MAX_SERVICE_SHUTDOWN_S, whichever is shorter.
    """
    settings = TelemetrySettings.from_environ(default_service_name, environ)
    for name in _CALLER_ECHOING_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    otlp: dict[str, Any] = {"timeout": settings.export_timeout_s}
    if is_one_shot:
        otlp["retryable_error_codes"] = _NO_RETRIES
    processors: list[SpanProcessor] = []
    for name in settings.traces_exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.traces_endpoint, **otlp)))
        else:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            processors.append(BatchSpanProcessor(ConsoleSpanExporter()))
    readers: list[MetricReader] = []
    interval_ms = settings.metric_export_interval_s * 1000
    for name in settings.metrics_exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter: Any = OTLPMetricExporter(endpoint=settings.metrics_endpoint, **otlp)
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
        shutdown_on_exit=not is_one_shot,
        shutdown_timeout_s=(
            settings.export_timeout_s
            if is_one_shot
            else min(settings.export_timeout_s, MAX_SERVICE_SHUTDOWN_S)
        ),
        sets_propagator=owns_process and not environ.get("OTEL_PROPAGATORS"),
    )
