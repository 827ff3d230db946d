"""The caller's trace context the decoder passes on to its encoder: W3C's well-formed headers only."""

from __future__ import annotations

import pytest

from tandem.decoder.api.trace_context import MAX_TRACESTATE_CHARS, trace_context

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_well_formed_traceparent_and_its_tracestate_are_passed_on() -> None:
    metadata = [("authorization", "Bearer t"), ("traceparent", PARENT), ("tracestate", "a=1,b=2")]
    assert trace_context(metadata) == (("traceparent", PARENT), ("tracestate", "a=1,b=2"))


def test_several_tracestate_headers_are_joined_as_one_list() -> None:
    metadata = [("traceparent", PARENT), ("tracestate", "a=1"), ("tracestate", "b=2")]
    assert trace_context(metadata) == (("traceparent", PARENT), ("tracestate", "a=1,b=2"))


@pytest.mark.parametrize(
    "parent",
    [
        "00-" + "a" * 7000,  # what a hostile caller sent: 7 KB, passed on as it came
        PARENT.upper(),
        PARENT + "-00",
        PARENT[:-1],
        "ff" + PARENT[2:],  # version ff is invalid
        "00-" + "0" * 32 + PARENT[35:],  # an all-zero trace ID
        PARENT[:36] + "0" * 16 + "-01",  # an all-zero parent ID
        "",
        "01" + PARENT[2:] + "-" + "x" * 457,  # a higher version past the SDK's 512 characters
        "01" + PARENT[2:] + "x",  # a higher version's more fields come after a dash
        " " + PARENT,  # padded: the SDK takes it, the rule does not
        PARENT + "\t",
    ],
)
def test_a_malformed_traceparent_is_dropped_with_its_tracestate(parent: str) -> None:
    assert trace_context([("traceparent", parent), ("tracestate", "a=1")]) == ()


@pytest.mark.parametrize("extra", ["", "-extra", "-" + "x" * 456])
def test_a_higher_version_is_passed_on_in_its_version_00_form(extra: str) -> None:
    # W3C: a version to come may carry more fields after a dash; a vendor reads the four it knows. A
    # tracing service took it as the caller's trace and sends it on as version 00: so does this path.
    metadata = [("traceparent", "01" + PARENT[2:] + extra), ("tracestate", "a=1")]
    assert trace_context(metadata) == (("traceparent", PARENT), ("tracestate", "a=1"))


def test_two_traceparents_or_none_pass_nothing_on() -> None:
    assert trace_context([("traceparent", PARENT), ("traceparent", PARENT)]) == ()
    assert trace_context([("tracestate", "a=1")]) == ()


def test_a_tracestate_over_the_spec_s_bound_is_dropped_and_its_traceparent_kept() -> None:
    at_bound = "k=" + "v" * (MAX_TRACESTATE_CHARS - 2)
    assert trace_context([("traceparent", PARENT), ("tracestate", at_bound)])[1] == ("tracestate", at_bound)
    over = [("traceparent", PARENT), ("tracestate", at_bound + "v")]
    assert trace_context(over) == (("traceparent", PARENT),)
