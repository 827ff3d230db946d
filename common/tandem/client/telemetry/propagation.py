"""How a caller's W3C trace context is read, when a service traces itself.

The decoder that does not trace passes a caller's context on by trace_context.py's rules: one
`traceparent` of the version-00 form, its `tracestate` headers joined with commas and dropped past
the 512 characters the spec has every vendor propagate. A tracing service read them with the SDK's
propagator instead, behind a server interceptor that kept only the last of a repeated header: a
repeated `traceparent` was taken (its last value), and a `tracestate` up to the SDK's 8192 characters
was extracted, then injected into every onward call. A caller's 7 KB tracestate went on to the encoder
past its metadata bound and came back as RESOURCE_EXHAUSTED 'encoder ... is full', blaming a healthy
encoder. Here both paths read by the same rules: `BoundedTraceContext` is the process's propagator once
tracing is on (`install_propagator`), and the server span (server_spans.py) hands it every value of a
repeated header rather than the last.
"""

from __future__ import annotations

from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators import textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

MAX_TRACESTATE_CHARS = 512
_TRACEPARENT = "traceparent"
_TRACESTATE = "tracestate"


class BoundedTraceContext(TraceContextTextMapPropagator):
    """W3C trace context, read as the decoder passes it on: a repeated `traceparent` is invalid (no
    context), and a `tracestate` past MAX_TRACESTATE_CHARS, its headers joined, is dropped."""

    def extract(
        self,
        carrier: textmap.CarrierT,
        context: Context | None = None,
        getter: textmap.Getter[textmap.CarrierT] = textmap.default_getter,
    ) -> Context:
        parents = getter.get(carrier, _TRACEPARENT) or []
        if len(parents) != 1:
            return Context() if context is None else context
        bounded = {_TRACEPARENT: parents[0]}
        state = ",".join(getter.get(carrier, _TRACESTATE) or [])
        if state and len(state) <= MAX_TRACESTATE_CHARS:
            bounded[_TRACESTATE] = state
        return super().extract(bounded, context)


def install_propagator() -> None:
    """Makes BoundedTraceContext (and W3C baggage, as the SDK's default has it) the process's
    propagator: the instrumentation reads the global one."""
    propagate.set_global_textmap(CompositePropagator([BoundedTraceContext(), W3CBaggagePropagator()]))
