"""The client commands' telemetry: one span around a command, its trace id on request, and exports
that cost a command at most their timeout, with one line when they fail.

`OTEL_*` configures it as it does the services (`tandem.client.telemetry.settings`). A command is
one-shot: its exports are tried once and bounded together by OTEL_EXPORTER_OTLP_TIMEOUT (an
unreachable collector turned a 1.4 s call into 16 s and four exporter messages). OpenTelemetry's own
warnings are held back during the command and summed up in one line at its end. `--trace` without an
exporter still prints a trace id (it is in the services' logs and spans if they export), and says
that this command recorded nothing and how to make it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from tandem.client.telemetry import Telemetry

NO_EXPORTER = (
    "not recorded here, no exporter is configured: OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:4317 sends "
    "spans to a collector, OTEL_TRACES_EXPORTER=console prints them"
)


class _Held(logging.Handler):
    """OpenTelemetry's warnings and errors, kept to be said once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def run_traced(name: str, is_traced: bool, run: Callable[[Telemetry], Awaitable[int]]) -> int:
    """`run` under a client span named `name`, exported where OTEL_* says; `is_traced` also makes a
    trace id when nothing is exported, and prints it."""
    from opentelemetry import trace

    from tandem.client.telemetry import setup_telemetry

    try:
        telemetry = setup_telemetry("tandem-cli", os.environ, always_trace=is_traced, is_one_shot=True)
    except ValueError as error:  # an OTEL_* variable it cannot use, named
        raise click.UsageError(str(error)) from None
    otel_log = logging.getLogger("opentelemetry")
    held = _Held()
    otel_log.addHandler(held)
    otel_log.propagate = False
    try:
        with telemetry.tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT) as span:
            if is_traced:
                trace_id = trace.format_trace_id(span.get_span_context().trace_id)
                said = "" if telemetry.is_exporting_traces else f"; {NO_EXPORTER}"
                print(f"trace id: {trace_id}{said}", file=sys.stderr)
            return await run(telemetry)
    finally:
        telemetry.shutdown()
        otel_log.removeHandler(held)
        otel_log.propagate = True
        if held.records:
            more = f" (and {len(held.records) - 1} more)" if len(held.records) > 1 else ""
            print(f"{name}: telemetry: {held.records[0].getMessage()}{more}", file=sys.stderr)
