"""How a caller's W3C trace context is read, when a service traces itself.

The decoder that does not trace passes a caller's context on by trace_context.py's rules: one
`traceparent` of at most 512 characters, `version-traceid-parentid-flags` in lowercase hex (IDs not
all zero), version ff invalid, version 00 exactly those 55 characters, a higher version possibly
carrying more fields after a dash (W3C's rule for versions to come); its `tracestate` headers joined
with commas and dropped past the 512 characters the spec has every vendor propagate. The SDK's own
reader differs at the edges (it took a version-00 header padded with spaces or tabs), so the rule is
checked here before the SDK reads what passed it. A tracing service read them with the SDK's
propagator instead, behind a server interceptor that kept only the last of a repeated header: a
repeated `traceparent` was taken (its last value), and a `tracestate` up to the SDK's 8192 characters
was extracted, then injected into every onward call. A caller's 7 KB tracestate went on to the encoder
past its metadata bound and came back as RESOURCE_EXHAUSTED 'encoder ... is full', blaming a healthy
encoder. Here both paths read by the same rules: `BoundedTraceContext` is the process's propagator once
tracing is on (`install_propagator`), and the server span (server_spans.py) hands it every value of a
repeated header rather than the last.
"""

from __future__ import annotations

import re

from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators import textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

MAX_TRACESTATE_CHARS = 512
MAX_TRACEPARENT_CHARS = 512  # the SDK's bound too
# trace_context.py's _TRACEPARENT, the same rule: kept alike by both modules' tests (the same cases).
_TRACEPARENT_FORM = re.compile(
    r"([0-9a-f]{2})-((?!0{32})[0-9a-f]{32})-((?!0{16})[0-9a-f]{16})-([0-9a-f]{2})(-.*)?"
)
_TRACEPARENT = "traceparent"
_TRACESTATE = "tracestate"


class BoundedTraceContext(TraceContextTextMapPropagator):
    """W3C trace context, read as the decoder passes it on: a repeated `traceparent`, or one outside
    the rule above, is invalid (no context), and a `tracestate` past MAX_TRACESTATE_CHARS, its headers
    joined, is dropped."""

    def extract(
        self,
        carrier: textmap.CarrierT,
        context: Context | None = None,
        getter: textmap.Getter[textmap.CarrierT] = textmap.default_getter,
    ) -> Context:
        parents = getter.get(carrier, _TRACEPARENT) or []
        if len(parents) != 1 or not is_traceparent(parents[0]):
            return Context() if context is None else context
        bounded = {_TRACEPARENT: parents[0]}
        state = ",".join(getter.get(carrier, _TRACESTATE) or [])
        if state and len(state) <= MAX_TRACESTATE_CHARS:
            bounded[_TRACESTATE] = state
        return super().extract(bounded, context)


def is_traceparent(value: str) -> bool:
    """Whether `value` is a `traceparent` the rule above reads a context in."""
    if len(value) > MAX_TRACEPARENT_CHARS or (match := _TRACEPARENT_FORM.fullmatch(value)) is None:
        return False
    version, more = match.group(1), match.group(5)
    return version != "ff" and not (version == "00" and more is not None)


def install_propagator() -> None:
    """Makes BoundedTraceContext (and W3C baggage, as the SDK's default has it) the process's
    propagator: the instrumentation reads the global one."""
    propagate.set_global_textmap(CompositePropagator([BoundedTraceContext(), W3CBaggagePropagator()]))
