"""OpenTelemetry for both services and their clients: settings, providers, tracing and metrics.

Built once at start by `setup_telemetry(service_name, environ)`; nothing here reads the environment
at import time. Export follows the OTel SDK's variables with one rule on top: nothing is exported
unless asked for (`settings.py` says how each `OTEL_*` variable is read).

- `settings.py`: what `OTEL_*` asks for, parsed and checked.
- `providers.py`: the process's tracer and meter providers and the gRPC interceptors (`Telemetry`).
- `propagation.py`: how a caller's W3C trace context is read (`BoundedTraceContext`).
- `server_spans.py`: the gRPC server span of each call, ending as its caller sees the call (`ServerSpans`).
- `tracing.py`: one served gen_ai operation's span and duration point (`ServerOperation`).
- `metrics.py`: the server's and the client's instruments.
- names (GenAI semantic conventions and Tandem's own) live in `tandem.client.semconv`, so a client can use
  them without the SDK; `error_type` (the `error.type` value) in `tandem.client.status`.

NOTE: off means free. With no exporter configured `Telemetry.is_enabled` is False: no providers, no
interceptors, and the servicers skip recording altogether, so per request they pay a few `is None`
checks and per token nothing. On, the per-request cost is a handful of spans and histogram points;
the decoder's engine thread only appends to a request's timeline (`engine/outputs/outputs.py`), which the
servicer turns into span events when the request ends.

Everything is re-exported here: `from tandem.client import telemetry as otel` then `otel.ServerOperation`.
"""

from ..semconv import *  # noqa: F403 (the names, as otel.GEN_AI_*)
from ..status import error_type
from .metrics import ClientMetrics, ServerMetrics
from .providers import (
    MAX_ATTRIBUTE_CHARS,
    MAX_SERVICE_SHUTDOWN_S,
    Telemetry,
    build_telemetry,
    setup_telemetry,
)
from .settings import TelemetrySettings
from .tracing import ServerOperation, epoch_ns

__all__ = [
    "MAX_ATTRIBUTE_CHARS",
    "MAX_SERVICE_SHUTDOWN_S",
    "ClientMetrics",
    "ServerMetrics",
    "ServerOperation",
    "Telemetry",
    "TelemetrySettings",
    "build_telemetry",
    "epoch_ns",
    "error_type",
    "setup_telemetry",
]
