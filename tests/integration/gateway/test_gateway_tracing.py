"""One trace from the HTTP request through the gateway into the encoder and the decoder: a caller's
`traceparent` is the parent of the gateway's server span, whose gRPC calls carry it on."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import torch
from aiohttp import web
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tandem.client import telemetry as otel
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.lookup import LookupEmbedder
from tandem.gateway.app import Gateway
from tandem.gateway.bodies import BodyWorkers
from tandem.gateway.callers import decoder_channels
from tandem.gateway.config import GatewayConfig
from tandem.gateway.encoders import gateway_encoder
from tests.integration.test_tracing import (
    EMBEDDINGS,
    MAX_MESSAGE_BYTES,
    TEXT_COMPLETION,
    named,
    start_stack,
    stop_stack,
    wait_for,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def test_a_chat_and_an_embedding_through_the_gateway_are_the_callers_trace(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    lookup = LookupEmbedder.load(tiny_model_dir, torch.float32)
    exporter = InMemorySpanExporter()

    def make(service: str) -> otel.Telemetry:
        return otel.build_telemetry(service, [SimpleSpanProcessor(exporter)], [InMemoryMetricReader()])

    stack = await start_stack(tiny_model_dir, tiny_fp32, lookup, make)
    gateway_telemetry = make("tandem-openai")
    decoder_address, encoder_address = stack.servers[0].address, stack.servers[1].address
    config = GatewayConfig(
        decoder_address=decoder_address,
        encoder_address=encoder_address,
        port=0,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )
    encoder = gateway_encoder(config, gateway_telemetry)
    callers = decoder_channels(config, gateway_telemetry.client_interceptors())  # completions go here
    workers = BodyWorkers(1)
    gateway = Gateway(config, encoder, callers, workers, tracer=gateway_telemetry.tracer)
    runner = web.AppRunner(gateway.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession(headers={"traceparent": TRACEPARENT}) as session:
            chat = {
                "model": "",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
            }
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as response:
                assert response.status == 200
                await response.read()
            embed = {"model": "", "input": "hello"}
            async with session.post(f"http://127.0.0.1:{port}/v1/embeddings", json=embed) as response:
                assert response.status == 200
        await wait_for(lambda: named(exporter, TEXT_COMPLETION) and named(exporter, EMBEDDINGS))
        spans = exporter.get_finished_spans()
        http = [s for s in spans if s.kind == SpanKind.SERVER and s.name.startswith("POST /v1/")]
        assert sorted(s.name for s in http) == ["POST /v1/chat/completions", "POST /v1/embeddings"]
        by_id = {s.context.span_id: s for s in spans}
        for name in (TEXT_COMPLETION, EMBEDDINGS):
            (span,) = named(exporter, name)
            assert format(span.context.trace_id, "032x") == TRACE_ID
            ancestor = span
            while ancestor.parent is not None and ancestor.parent.span_id in by_id:
                ancestor = by_id[ancestor.parent.span_id]
            assert ancestor in http  # the service's work hangs under the gateway's HTTP span
    finally:
        await runner.cleanup()
        await callers.close()
        workers.close()
        await encoder.close()
        await stop_stack(stack)
