"""One served gen_ai operation: its span (when tracing) and its request-duration point."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .. import errors
from ..semconv import (
    ERROR_TYPE,
    GEN_AI_OPERATION_NAME,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_REQUEST_MODEL,
    PROVIDER,
)
from ..status import error_type
from .metrics import ServerMetrics
from .providers import Telemetry


def epoch_ns(monotonic_s: float, now_monotonic_s: float, now_epoch_ns: int) -> int:
    """A time.monotonic() reading as Unix-epoch nanoseconds, given one pair of simultaneous readings."""
    return now_epoch_ns + int((monotonic_s - now_monotonic_s) * 1e9)


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
