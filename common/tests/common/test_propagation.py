"""A tracing service reads a caller's W3C trace context by the rules the decoder passes it on by
(services/decoder/.../trace_context.py): one traceparent, and a tracestate of at most 512 characters.
Which traceparents each reads a context in, and as what, is one table run through both:
services/decoder/tests/api/test_trace_context.py's TRACEPARENTS."""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tandem.client import telemetry as otel
from tandem.client.telemetry.propagation import MAX_TRACESTATE_CHARS, BoundedTraceContext

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER_PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4737-00f067aa0ba902b8-01"


def _state(num_chars: int) -> str:
    """A valid tracestate of exactly `num_chars` (a member's value may have at most 256)."""
    members: list[str] = []
    used = 0  # characters of the members so far, each with its comma
    while num_chars - used > 130:
        key = f"k{len(members)}="
        members.append(key + "v" * (64 - len(key)))
        used += 65
    key = f"z{len(members)}="
    members.append(key + "v" * (num_chars - used - len(key)))
    return ",".join(members)


def _extracted(carrier: dict[str, list[str]]) -> trace.SpanContext:
    return trace.get_current_span(BoundedTraceContext().extract(carrier)).get_span_context()


def test_a_tracestate_within_512_characters_is_kept() -> None:
    context = _extracted({"traceparent": [PARENT], "tracestate": [_state(MAX_TRACESTATE_CHARS)]})
    assert context.is_valid and context.trace_state.to_header() == _state(MAX_TRACESTATE_CHARS)


def test_a_tracestate_past_512_characters_is_dropped_and_the_traceparent_kept() -> None:
    # Kept up to the SDK's 8192 and injected onward, it put the encoder's metadata past its bound.
    context = _extracted({"traceparent": [PARENT], "tracestate": [_state(MAX_TRACESTATE_CHARS + 1)]})
    assert context.is_valid and context.trace_id == int(PARENT.split("-")[1], 16)
    assert len(context.trace_state) == 0


def test_repeated_tracestate_headers_are_joined_and_bounded_together() -> None:
    context = _extracted({"traceparent": [PARENT], "tracestate": ["a=1", "b=2"]})
    assert context.trace_state.to_header() == "a=1,b=2"
    context = _extracted({"traceparent": [PARENT], "tracestate": [_state(300), "b=" + "2" * 300]})
    assert len(context.trace_state) == 0


def test_a_repeated_traceparent_is_no_context() -> None:
    assert not _extracted({"traceparent": [PARENT, OTHER_PARENT]}).is_valid
    assert not _extracted({"traceparent": [PARENT, PARENT]}).is_valid


class _AppsOwn(TraceContextTextMapPropagator):
    """An application's own propagator, set before it builds a Tandem client."""


def test_the_client_library_and_otel_propagators_leave_the_process_propagator_as_it_was() -> None:
    # The library inside someone's application replaced its propagator (its own headers went, a
    # traceparent it had not asked for was sent); OTEL_PROPAGATORS names the process's own choice.
    before = propagate.get_global_textmap()
    try:
        for environ, owns_process in (({}, False), ({"OTEL_PROPAGATORS": "b3"}, True)):
            own = _AppsOwn()
            propagate.set_global_textmap(own)
            otel.setup_telemetry(
                "tandem-client", environ, always_trace=True, owns_process=owns_process
            ).shutdown()
            assert propagate.get_global_textmap() is own
        otel.setup_telemetry("tandem-decoder", {}, always_trace=True).shutdown()  # a service: bounded
        assert "BoundedTraceContext" in repr(propagate.get_global_textmap()._propagators)  # type: ignore[attr-defined]
    finally:
        propagate.set_global_textmap(before)


def test_span_attributes_are_cut_but_an_exceptions_stacktrace_keeps_the_frame_that_raised() -> None:
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-decoder", [SimpleSpanProcessor(exporter)])
    tracer = telemetry.tracer_provider.get_tracer("test")  # type: ignore[union-attr]
    with tracer.start_as_current_span("op", record_exception=False) as span:
        span.set_attribute("stop", "s" * 5000)
        span.record_exception(RuntimeError("x" * 3000 + " the end"))
    (finished,) = exporter.get_finished_spans()
    assert len(finished.attributes["stop"]) == otel.MAX_ATTRIBUTE_CHARS  # type: ignore[index,arg-type]
    (event,) = finished.events
    assert event.attributes["exception.message"].endswith(" the end")  # type: ignore[index,union-attr]
