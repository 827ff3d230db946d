"""The caller's trace context the decoder passes on to its encoder: W3C's well-formed headers only."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from tandem.client.telemetry.propagation import BoundedTraceContext
from tandem.decoder.api.trace_context import MAX_TRACESTATE_CHARS, trace_context

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_well_formed_traceparent_and_its_tracestate_are_passed_on() -> None:
    metadata = [("authorization", "Bearer t"), ("traceparent", PARENT), ("tracestate", "a=1,b=2")]
    assert trace_context(metadata) == (("traceparent", PARENT), ("tracestate", "a=1,b=2"))


def test_several_tracestate_headers_are_joined_as_one_list() -> None:
    metadata = [("traceparent", PARENT), ("tracestate", "a=1"), ("tracestate", "b=2")]
    assert trace_context(metadata) == (("traceparent", PARENT), ("tracestate", "a=1,b=2"))


# One table for both readers of a caller's traceparent (one function reads it: `version_00`): what
# this decoder passes on when it does not trace, and the context a tracing service takes
# (BoundedTraceContext), written as the version-00 header; None: no context, dropped.
TRACEPARENTS: dict[str, tuple[str, str | None]] = {
    "version 00": (PARENT, PARENT),
    "not sampled": (PARENT[:-2] + "00", PARENT[:-2] + "00"),
    "sampled and random (Level 2)": (PARENT[:-2] + "03", PARENT[:-2] + "03"),
    "flags W3C does not define": (PARENT[:-2] + "ff", PARENT[:-2] + "03"),
    "a reserved flag alone": (PARENT[:-2] + "04", PARENT[:-2] + "00"),
    "a higher version": ("01" + PARENT[2:], PARENT),
    "a higher version with a field more": ("01" + PARENT[2:] + "-extra", PARENT),
    "a higher version at 512 characters": ("01" + PARENT[2:] + "-" + "x" * 456, PARENT),
    "a higher version's undefined flags": ("01" + PARENT[2:-2] + "fd-extra", PARENT[:-2] + "01"),
    "7 KB, as a hostile caller sent": ("00-" + "a" * 7000, None),
    "uppercase": (PARENT.upper(), None),
    "version 00 with a field more": (PARENT + "-00", None),
    "a character short": (PARENT[:-1], None),
    "version ff": ("ff" + PARENT[2:], None),
    "an all-zero trace ID": ("00-" + "0" * 32 + PARENT[35:], None),
    "an all-zero parent ID": (PARENT[:36] + "0" * 16 + "-01", None),
    "empty": ("", None),
    "a higher version past 512 characters": ("01" + PARENT[2:] + "-" + "x" * 457, None),
    "a higher version's more fields without a dash": ("01" + PARENT[2:] + "x", None),
    "padded with a space (the SDK took it)": (" " + PARENT, None),
    "padded with a tab": (PARENT + "\t", None),
}


@pytest.mark.parametrize(("sent", "read"), TRACEPARENTS.values(), ids=TRACEPARENTS.keys())
def test_both_readers_of_a_traceparent_agree_on_what_goes_on(sent: str, read: str | None) -> None:
    passed = trace_context([("traceparent", sent), ("tracestate", "a=1")])
    assert passed == ((("traceparent", read), ("tracestate", "a=1")) if read is not None else ())
    span = trace.get_current_span(BoundedTraceContext().extract({"traceparent": [sent]})).get_span_context()
    taken = f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}" if span.is_valid else None
    assert taken == read


def test_two_traceparents_or_none_pass_nothing_on() -> None:
    assert trace_context([("traceparent", PARENT), ("traceparent", PARENT)]) == ()
    assert trace_context([("tracestate", "a=1")]) == ()


def test_a_tracestate_over_the_spec_s_bound_is_dropped_and_its_traceparent_kept() -> None:
    at_bound = "k=" + "v" * (MAX_TRACESTATE_CHARS - 2)
    assert trace_context([("traceparent", PARENT), ("tracestate", at_bound)])[1] == ("tracestate", at_bound)
    over = [("traceparent", PARENT), ("tracestate", at_bound + "v")]
    assert trace_context(over) == (("traceparent", PARENT),)
