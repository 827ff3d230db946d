"""Telemetry setup from OTEL_* variables, and the recording helpers, without any server."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer, StatusCode

from tandem.client import errors
from tandem.client import telemetry as otel


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_nothing_configured_means_telemetry_off() -> None:
    settings = otel.TelemetrySettings.from_environ("tandem-decoder", {})
    assert settings.traces_exporters == () and settings.metrics_exporters == ()
    off = otel.setup_telemetry("tandem-decoder", {})
    assert not off.is_enabled and isinstance(off.tracer, NoOpTracer)
    assert off.server_interceptors() == [] and off.client_interceptors() == []


def test_an_otlp_endpoint_turns_on_otlp_traces_and_metrics() -> None:
    settings = otel.TelemetrySettings.from_environ(
        "tandem-decoder", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    )
    assert settings.traces_exporters == ("otlp",) and settings.metrics_exporters == ("otlp",)
    assert settings.traces_endpoint == settings.metrics_endpoint == "http://collector:4317"
    # Nothing listens there; nothing is recorded either, so shutdown has nothing to send.
    telemetry = otel.setup_telemetry("tandem-decoder", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    try:
        assert telemetry.is_tracing and telemetry.is_metrics
        assert len(telemetry.server_interceptors()) == 1 and len(telemetry.client_interceptors()) == 4
    finally:
        telemetry.shutdown()


def test_exporter_variables_pick_exporters_per_signal() -> None:
    settings = otel.TelemetrySettings.from_environ(
        "tandem-encoder",
        {
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        },
    )
    assert settings.traces_exporters == ("console",) and settings.metrics_exporters == ()


def test_sdk_disabled_wins_over_everything() -> None:
    environ = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    assert not otel.setup_telemetry("tandem-decoder", environ).is_enabled


def test_unknown_exporter_is_an_error_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        otel.TelemetrySettings.from_environ("tandem-decoder", {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_service_name_is_the_services_own_unless_overridden() -> None:
    environ = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=dev,service.name=ignored"}
    settings = otel.TelemetrySettings.from_environ("tandem-decoder", environ)
    assert settings.service_name == "ignored"
    assert settings.resource_attributes == {"deployment.environment": "dev"}
    override = otel.TelemetrySettings.from_environ(
        "tandem-decoder", {**environ, "OTEL_SERVICE_NAME": "dec-a"}
    )
    assert override.service_name == "dec-a"
    assert otel.TelemetrySettings.from_environ("tandem-decoder", {}).service_name == "tandem-decoder"


def test_health_checks_and_excluded_services_are_not_traced() -> None:
    settings = otel.TelemetrySettings.from_environ(
        "tandem-decoder", {"OTEL_PYTHON_GRPC_EXCLUDED_SERVICES": "grpc.reflection.v1alpha.ServerReflection"}
    )
    telemetry = otel.build_telemetry(
        "tandem-decoder",
        [SimpleSpanProcessor(InMemorySpanExporter())],
        excluded_grpc_services=settings.excluded_grpc_services,
    )
    traced = telemetry.rpc_filter
    assert traced(_Details("/tandem.v1.Decoder/Generate"))
    assert not traced(_Details("/grpc.health.v1.Health/Check"))
    assert not traced(_Details("/grpc.health.v1.Health/Watch"))
    assert not traced(_Details("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"))


def test_always_trace_makes_trace_ids_without_exporting() -> None:
    telemetry = otel.setup_telemetry("tandem-cli", {}, always_trace=True)
    with telemetry.tracer.start_as_current_span("generate") as span:
        assert span.get_span_context().trace_id != 0
    assert telemetry.is_tracing and not telemetry.is_metrics


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (errors.InvalidArgument("prompt", "empty"), "INVALID_ARGUMENT"),
        (errors.ResourceExhausted("queue full"), "RESOURCE_EXHAUSTED"),
        (errors.Unavailable("loading"), "UNAVAILABLE"),
        (asyncio.CancelledError(), "CANCELLED"),
        (KeyError("bug"), "KeyError"),
    ],
)
def test_error_type_is_the_status_a_client_sees(exc: BaseException, expected: str) -> None:
    assert otel.error_type(exc) == expected


def test_monotonic_times_convert_to_epoch_nanoseconds() -> None:
    now_s, now_ns = time.monotonic(), time.time_ns()
    assert otel.epoch_ns(now_s - 1.5, now_s, now_ns) == now_ns - 1_500_000_000


def test_a_failed_operation_before_admission_is_rejected_and_its_span_errored() -> None:
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry = otel.build_telemetry("tandem-decoder", [SimpleSpanProcessor(exporter)], [reader])
    op = otel.ServerOperation(
        telemetry, otel.ServerMetrics(telemetry.meter), otel.OPERATION_TEXT_COMPLETION, "m"
    )
    op.add_timeline([("queued", time.monotonic(), {"positions.start": 0})])
    op.fail(errors.ResourceExhausted("queue full"))
    op.end()
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion m" and span.status.status_code is StatusCode.ERROR
    assert span.attributes[otel.ERROR_TYPE] == "RESOURCE_EXHAUSTED"
    assert [(e.name, dict(e.attributes)) for e in span.events] == [("queued", {"tandem.positions.start": 0})]
    metrics = {
        m.name: m.data.data_points
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    (rejected,) = metrics[otel.TANDEM_SERVER_REJECTED]
    assert rejected.value == 1 and rejected.attributes[otel.ERROR_TYPE] == "RESOURCE_EXHAUSTED"
    (duration,) = metrics[otel.GEN_AI_SERVER_REQUEST_DURATION]
    assert duration.attributes[otel.ERROR_TYPE] == "RESOURCE_EXHAUSTED"


class _UnavailableCollector(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    """An OTLP collector that answers every export UNAVAILABLE, counting them."""

    def __init__(self) -> None:
        self.num_exports = {"traces": 0, "metrics": 0}

    def Export(self, request, context):  # noqa: N802 (the service's name)
        self.num_exports["traces" if hasattr(request, "resource_spans") else "metrics"] += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "down for maintenance")


@pytest.fixture
def unavailable_collector() -> Iterator[tuple[str, _UnavailableCollector]]:
    collector = _UnavailableCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", collector
    server.stop(0)


def test_a_one_shot_command_asks_an_unavailable_collector_once(unavailable_collector) -> None:
    # A command's exports used to be retried with backoff: a 1.4 s call took 16.1 s and logged four times.
    endpoint, collector = unavailable_collector
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": "5"}
    telemetry = otel.setup_telemetry("tandem-cli", environ, is_one_shot=True)
    assert telemetry.shutdown_timeout_s == 5.0
    with telemetry.tracer.start_as_current_span("generate"):
        telemetry.meter.create_counter("calls").add(1)
    telemetry.shutdown()
    assert collector.num_exports == {"traces": 1, "metrics": 1}


class _Stuck(SpanProcessor):
    """A span processor whose shutdown waits, as an export to a collector that never answers does."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.is_shut_down = False

    def shutdown(self) -> None:
        self.released.wait()
        self.is_shut_down = True


def test_a_bounded_shutdown_returns_while_an_export_still_waits() -> None:
    stuck = _Stuck()
    telemetry = otel.build_telemetry("tandem-cli", [stuck], shutdown_on_exit=False, shutdown_timeout_s=0.05)
    telemetry.shutdown()  # returns: it does not wait for the stuck processor
    assert not stuck.is_shut_down
    stuck.released.set()


def test_exports_are_bounded_by_the_otlp_timeout_variable() -> None:
    assert otel.TelemetrySettings.from_environ("x", {}).export_timeout_s == 10.0
    assert (
        otel.TelemetrySettings.from_environ("x", {"OTEL_EXPORTER_OTLP_TIMEOUT": "2.5"}).export_timeout_s
        == 2.5
    )
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TIMEOUT='soon': expected seconds"):
        otel.TelemetrySettings.from_environ("x", {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"})


def test_a_services_shutdown_waits_the_export_timeout_or_five_seconds_whichever_is_less() -> None:
    # Unbounded, a hung collector held an idle encoder's exit 31.7 s, past the 15 s deploy/ allows.
    for timeout, expected in (("30", otel.MAX_SERVICE_SHUTDOWN_S), ("2", 2.0)):
        environ = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_TIMEOUT": timeout,
        }
        telemetry = otel.setup_telemetry("tandem-encoder", environ)
        try:
            assert telemetry.shutdown_timeout_s == expected
        finally:
            telemetry.shutdown()


def test_string_attributes_are_cut_to_max_attribute_chars() -> None:
    # A refused request's 16 stop strings of 1 MB made a 16 MB span; the collector took 4 MiB a batch.
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-decoder", [SimpleSpanProcessor(exporter)])
    with telemetry.tracer.start_as_current_span("generate") as span:
        span.set_attribute("one", "x" * 1_000_000)
        span.set_attribute("many", ["y" * 1_000_000] * 16)
    (finished,) = exporter.get_finished_spans()
    assert len(finished.attributes["one"]) == otel.MAX_ATTRIBUTE_CHARS
    assert [len(s) for s in finished.attributes["many"]] == [otel.MAX_ATTRIBUTE_CHARS] * 16


def test_loggers_that_echo_a_callers_header_keep_only_errors() -> None:
    # An invalid tracestate was logged whole at WARNING, once per request (up to 8 KB a line).
    telemetry = otel.setup_telemetry("tandem-gateway", {"OTEL_TRACES_EXPORTER": "console"})
    telemetry.shutdown()
    for name in ("opentelemetry.trace.span", "opentelemetry.trace.propagation.tracecontext"):
        assert not logging.getLogger(name).isEnabledFor(logging.WARNING)
