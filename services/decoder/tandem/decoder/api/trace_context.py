"""The caller's W3C trace context, as the decoder passes it on to its encoder.

When the decoder does not trace itself, a caller's `traceparent` and `tracestate` go on to the encoder
so that its spans join the caller's trace. Only what the W3C Trace Context spec has a vendor pass on,
read by the function a tracing service reads it by (`tandem.client.telemetry.propagation.version_00`):
one `traceparent` of at most 512 characters (the SDK's bound), `version-traceid-parentid-flags` in
lowercase hex (IDs not all zero), version ff invalid, version 00 exactly those 55 characters, a higher
version possibly carrying more fields after a dash (W3C: a future version may add fields, and a vendor
reads the four it knows). It goes on in the version-00 form of those four, the flags W3C does not define
set to zero, as a tracing service sends it: the rest means nothing to this decoder. Its `tracestate`
goes on only beside such a traceparent and within the 512 characters the spec has every vendor propagate
(its several headers joined with commas, as the spec reads them). Anything else is dropped, as the spec
says of an invalid traceparent. Passed on as they came, a caller's 15 KB tracestate exceeded the
encoder's metadata limit and came back to the caller as RESOURCE_EXHAUSTED 'encoder ... is full',
blaming a healthy encoder. A version-01 traceparent with a field more was the caller's trace on the
tracing path and dropped here.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.client.telemetry.propagation import MAX_TRACESTATE_CHARS, version_00


def trace_context(metadata: Sequence[tuple[str, str | bytes]]) -> tuple[tuple[str, str], ...]:
    """The `traceparent` and `tracestate` entries of `metadata` fit to pass on; () when its
    traceparent is missing, repeated or malformed."""
    parents = [value for key, value in metadata if key == "traceparent"]
    if len(parents) != 1 or not isinstance(parents[0], str) or (parent := version_00(parents[0])) is None:
        return ()
    states = [value for key, value in metadata if key == "tracestate"]
    state = ",".join(value for value in states if isinstance(value, str))
    if not state or len(state) > MAX_TRACESTATE_CHARS:
        return (("traceparent", parent),)
    return (("traceparent", parent), ("tracestate", state))
