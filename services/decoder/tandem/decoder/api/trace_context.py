"""The caller's W3C trace context, as the decoder passes it on to its encoder.

When the decoder does not trace itself, a caller's `traceparent` and `tracestate` go on to the encoder
so that its spans join the caller's trace. Only what the W3C Trace Context spec has a vendor pass on:
a `traceparent` of the version-00 form (55 characters: version, 32-hex trace ID, 16-hex parent ID,
flags; IDs not all zero, version not ff), and its `tracestate` only beside such a traceparent and
within the 512 characters the spec has every vendor propagate (its several headers joined with
commas, as the spec reads them). Anything else is dropped, as the spec says of an invalid
traceparent. Passed on as they came, a caller's 15 KB tracestate exceeded the encoder's metadata limit
and came back to the caller as RESOURCE_EXHAUSTED 'encoder ... is full', blaming a healthy encoder.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_TRACESTATE_CHARS = 512
_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def trace_context(metadata: Sequence[tuple[str, str | bytes]]) -> tuple[tuple[str, str], ...]:
    """The `traceparent` and `tracestate` entries of `metadata` fit to pass on; () when its
    traceparent is missing, repeated or malformed."""
    parents = [value for key, value in metadata if key == "traceparent"]
    if len(parents) != 1 or not isinstance(parents[0], str) or not _TRACEPARENT.fullmatch(parents[0]):
        return ()
    states = [value for key, value in metadata if key == "tracestate"]
    state = ",".join(value for value in states if isinstance(value, str))
    if not state or len(state) > MAX_TRACESTATE_CHARS:
        return (("traceparent", parents[0]),)
    return (("traceparent", parents[0]), ("tracestate", state))
