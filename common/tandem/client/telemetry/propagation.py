"""How a caller's W3C trace context is read, when a service traces itself.

One rule for a `traceparent` (`version_00`), which the decoder that does not trace passes a caller's
context on by too (trace_context.py): one `traceparent` of at most 512 characters,
`version-traceid-parentid-flags` in lowercase hex (IDs not all zero), version ff invalid, version 00
exactly those 55 characters, a higher version possibly carrying more fields after a dash (W3C's rule for
versions to come), read as its version-00 form with only the flags W3C defines (sampled, and Level 2's
random: "other flags ... vendors MUST set those to zero"); its `tracestate` headers joined with commas
and dropped past the 512 characters the spec has every vendor propagate. The SDK's own reader differs at
the edges (it took a version-00 header padded with spaces or tabs, and a higher version's whole flags
byte), so the SDK reads the version-00 form the rule gives. A tracing service read them with the SDK's
propagator instead, behind a server interceptor that kept only the last of a repeated header: a repeated
`traceparent` was taken (its last value), and a `tracestate` up to the SDK's 8192 characters was
extracted, then injected into every onward call. A caller's 7 KB tracestate went on to the encoder past
its metadata bound and came back as RESOURCE_EXHAUSTED 'encoder ... is full', blaming a healthy encoder.
Here both paths read by the same rules: `BoundedTraceContext` is the process's propagator once tracing
is on (`install_propagator`), and the server span (server_spans.py) hands it every value of a repeated
header rather than the last.
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
_TRACEPARENT_FORM = re.compile(
    r"([0-9a-f]{2})-((?!0{32})[0-9a-f]{32})-((?!0{16})[0-9a-f]{16})-([0-9a-f]{2})(-.*)?"
)
# The trace flags W3C defines: sampled (0x01) and, in Trace Context Level 2, random (0x02: the trace
# ID's right-most 7 bytes random; an ID passed on unchanged stays so). The others are reserved, and a
# vendor must set them to zero: passed on whole, a caller's 0xff went to the encoder as it came.
KNOWN_TRACE_FLAGS = 0x03
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
        if len(parents) != 1 or (parent := version_00(parents[0])) is None:
            return Context() if context is None else context
        bounded = {_TRACEPARENT: parent}
        state = ",".join(getter.get(carrier, _TRACESTATE) or [])
        if state and len(state) <= MAX_TRACESTATE_CHARS:
            bounded[_TRACESTATE] = state
        return super().extract(bounded, context)


def version_00(traceparent: str) -> str | None:
    """`traceparent` in its version-00 form (its trace ID, parent ID, and the flags W3C defines), as a
    service sends it on; None where the rule above reads no context in it."""
    if (
        len(traceparent) > MAX_TRACEPARENT_CHARS
        or (match := _TRACEPARENT_FORM.fullmatch(traceparent)) is None
    ):
        return None
    version, trace_id, parent_id, flags, more = match.groups()
    if version == "ff" or (version == "00" and more is not None):
        return None
    return f"00-{trace_id}-{parent_id}-{int(flags, 16) & KNOWN_TRACE_FLAGS:02x}"


def install_propagator() -> None:
    """Makes BoundedTraceContext (and W3C baggage, as the SDK's default has it) the process's
    propagator: the instrumentation reads the global one."""
    propagate.set_global_textmap(CompositePropagator([BoundedTraceContext(), W3CBaggagePropagator()]))
