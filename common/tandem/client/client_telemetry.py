"""The clients' telemetry, OpenTelemetry optional: nothing here imports it at load. The process's own
telemetry when the `OTEL_*` environment asks for an exporter (`telemetry_from_environ`), and a call's
`gen_ai.client.operation.duration` (`CallDuration`) under its gen_ai attributes (`call_attributes`)."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc

from . import semconv

if TYPE_CHECKING:  # OpenTelemetry is optional: a caller that passes telemetry has it installed
    from .pb.tandem.v1 import decoder_pb2
    from .telemetry import ClientMetrics, Telemetry

log = logging.getLogger(__name__)


def call_attributes(operation: str, model: str) -> dict[str, str]:
    attributes = {semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER}
    if model:
        attributes[semconv.GEN_AI_REQUEST_MODEL] = model
    return attributes


class CallDuration:
    """A Generate call's `gen_ai.client.operation.duration`, recorded as its end is read (an
    `ObservedStream`'s observer: a command that shuts telemetry down right after keeps it)."""

    def __init__(self, metrics: ClientMetrics, attributes: dict[str, str]) -> None:
        self._metrics = metrics
        self._attributes = attributes
        self._start = time.monotonic()

    def on_response(self, response: decoder_pb2.GenerateResponse) -> None:
        pass

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        ok = code == grpc.StatusCode.OK
        attributes = self._attributes if ok else {**self._attributes, semconv.ERROR_TYPE: code.name}
        self._metrics.record(attributes, time.monotonic() - self._start)


def telemetry_from_environ(environ: Mapping[str, str] | None = None) -> Telemetry | None:
    """The process's client telemetry when `OTEL_*` asks for an exporter, else None.

    Built once per process and environment (OpenTelemetry's providers are per process too), and
    flushed at exit. None, with a warning, when OpenTelemetry is not installed.
    """
    variables = {
        k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("OTEL_")
    }
    return _telemetry_for(tuple(sorted(variables.items()))) if variables else None


@functools.cache
def _telemetry_for(variables: tuple[tuple[str, str], ...]) -> Telemetry | None:
    try:
        from .telemetry import TelemetrySettings, setup_telemetry
    except ImportError:
        log.warning("OTEL_* is set but OpenTelemetry is not installed: pip install 'tandem-client[otel]'")
        return None
    environ = dict(variables)
    settings = TelemetrySettings.from_environ("tandem-client", environ)
    if not settings.traces_exporters and not settings.metrics_exporters:
        return None
    return setup_telemetry("tandem-client", environ, owns_process=False)  # the application's propagator stays
