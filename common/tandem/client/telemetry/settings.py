"""What the `OTEL_*` environment variables ask for, parsed and checked; no OpenTelemetry import.

- traces: `OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`; comma-separated). Unset, it is `otlp`
  when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, else `none`.
- metrics: `OTEL_METRICS_EXPORTER` likewise (`..._METRICS_ENDPOINT`), every
  `OTEL_METRIC_EXPORT_INTERVAL` ms.
- `OTEL_EXPORTER_OTLP_TIMEOUT`: seconds one OTLP export may take, retries included (10; seconds, as
  OpenTelemetry's Python exporter reads it).
- `OTEL_SERVICE_NAME` overrides the service's own name; `OTEL_RESOURCE_ATTRIBUTES` are added;
  `OTEL_SDK_DISABLED=true` turns everything off.
- gRPC health checks are never traced; `OTEL_PYTHON_GRPC_EXCLUDED_SERVICES` excludes more services.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote


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
    export_timeout_s: float  # one OTLP export's bound, retries included
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
        timeout = environ.get("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TIMEOUT={timeout!r}: expected seconds") from None
        if not timeout_s > 0:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TIMEOUT={timeout!r}: must be > 0")
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
            export_timeout_s=timeout_s,
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
