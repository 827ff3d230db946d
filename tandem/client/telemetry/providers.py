"""The process's tracer and meter providers, built from settings, and the gRPC interceptors over them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import any_of, health_check, negate
from opentelemetry.instrumentation.grpc.filters import service_name as grpc_service
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .settings import TelemetrySettings

_INSTRUMENTATION_SCOPE = "tandem"


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
