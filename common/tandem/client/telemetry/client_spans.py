"""A client's gen_ai spans: one per Generate or Embed call, parent of the gRPC client span.

The gRPC interceptor's span knows the method and the status; this one carries what the GenAI
semantic conventions ask of a client (`gen_ai.request.*`, `gen_ai.response.*`, `gen_ai.usage.*`,
`gen_ai.response.time_to_first_chunk` as the client measured it). A Generate span is read off the
stream as the caller iterates it and ends when the caller reads the stream's end or its error, before
the read returns (`GenerateSpan`, an observer of `tandem.client.observed_stream.ObservedStream`, which
says why).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .. import semconv
from ..pb.tandem.v1 import decoder_pb2, encoder_pb2
from ..status import error_type


class ClientSpans:
    """Starts the spans of one client's calls on `tracer`; `server`: the (address, port) its calls go
    to, as `tandem.client.addresses.server_of` names it (None: several servers, no one of them named)."""

    def __init__(self, tracer: trace.Tracer, server: tuple[str, int | None] | None = None) -> None:
        self.tracer = tracer
        self._server_attributes: dict[str, Any] = {}
        if server is not None:
            address, port = server
            self._server_attributes[semconv.SERVER_ADDRESS] = address
            if port is not None:
                self._server_attributes[semconv.SERVER_PORT] = port

    def generate(
        self, request: decoder_pb2.GenerateRequest, start: Callable[[], grpc.aio.UnaryStreamCall]
    ) -> tuple[grpc.aio.UnaryStreamCall, GenerateSpan]:
        """Runs `start` (the stub call) under a `text_completion` span; returns the call and the span,
        which the caller's `ObservedStream` of the call ends."""
        span = self._span(semconv.OPERATION_TEXT_COMPLETION, request.model, _request_attributes(request))
        with trace.use_span(span, end_on_exit=False):  # the gRPC span (and traceparent) under it
            call = start()
        return call, GenerateSpan(span)

    async def embed(
        self, request: encoder_pb2.EmbedRequest, call: Callable[[], Awaitable[encoder_pb2.EmbedResponse]]
    ) -> encoder_pb2.EmbedResponse:
        span = self._span(semconv.OPERATION_EMBEDDINGS, request.model, {})
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            try:
                response = await call()
            except (grpc.RpcError, asyncio.CancelledError) as exc:
                _fail(span, error_type(exc), str(exc))
                raise
            span.set_attributes(
                {
                    semconv.GEN_AI_USAGE_INPUT_TOKENS: response.usage.input_tokens,
                    semconv.GEN_AI_EMBEDDINGS_DIMENSION_COUNT: int(response.embeddings.shape[-1])
                    if response.embeddings.shape
                    else 0,
                }
            )
            return response

    def _span(self, operation: str, model: str, attributes: dict[str, Any]) -> Span:
        attributes = {
            semconv.GEN_AI_OPERATION_NAME: operation,
            semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER,
            **({semconv.GEN_AI_REQUEST_MODEL: model} if model else {}),
            **self._server_attributes,
            **attributes,
        }
        name = f"{operation} {model}" if model else operation
        return self.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)


class GenerateSpan:
    """A Generate call's span, annotated by its responses and ended with the call (`ObservedStream`)."""

    def __init__(self, span: Span) -> None:
        self._span = span
        self._start = time.monotonic()
        self._is_first_token = True

    def on_response(self, response: decoder_pb2.GenerateResponse) -> None:
        event = response.WhichOneof("event")
        if event == "accepted" and response.request_id:
            self._span.set_attribute(semconv.GEN_AI_RESPONSE_ID, response.request_id)
        elif event == "delta" and self._is_first_token and response.delta.token_ids:
            self._is_first_token = False
            elapsed = time.monotonic() - self._start
            self._span.set_attribute(semconv.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, elapsed)
        elif event == "finished":
            finished = response.finished
            reason = decoder_pb2.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_").lower()
            self._span.set_attributes(
                {
                    semconv.GEN_AI_RESPONSE_FINISH_REASONS: (reason,),
                    semconv.GEN_AI_USAGE_INPUT_TOKENS: finished.usage.input_tokens,
                    semconv.GEN_AI_USAGE_OUTPUT_TOKENS: finished.usage.output_tokens,
                }
            )

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        if code != grpc.StatusCode.OK:
            _fail(self._span, code.name, details or code.name)
        self._span.end()


def _fail(span: Span, kind: str, description: str) -> None:
    span.set_attribute(semconv.ERROR_TYPE, kind)
    span.set_status(Status(StatusCode.ERROR, f"{kind}: {description}"))


def _request_attributes(request: decoder_pb2.GenerateRequest) -> dict[str, Any]:
    sampling, stopping = request.sampling, request.stopping
    attributes: dict[str, Any] = {}
    if stopping.HasField("max_new_tokens"):
        attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] = stopping.max_new_tokens
    for name, key in (
        ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE),
        ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
        ("top_k", semconv.GEN_AI_REQUEST_TOP_K),
        ("seed", semconv.GEN_AI_REQUEST_SEED),
    ):
        if sampling.HasField(name):
            attributes[key] = getattr(sampling, name)
    if stopping.stop_sequences:
        attributes[semconv.GEN_AI_REQUEST_STOP_SEQUENCES] = list(stopping.stop_sequences)
    return attributes
