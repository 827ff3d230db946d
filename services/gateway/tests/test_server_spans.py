"""The gateway's server span: named by the route (the method alone for a path no route matches),
carrying the status the caller got, ERROR only for a 5xx (a caller that leaves is none; a request the
gateway itself cuts is, its error.type `tandem.gateway_cut`, with the status it had sent), and the
caller's trace context read by the services' rules (a repeated traceparent is none)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tandem.client import telemetry as otel
from tandem.gateway.app import Gateway
from tandem.gateway.bodies import BodyWorkers
from tandem.gateway.callers import decoder_channels
from tandem.gateway.config import GatewayConfig
from tandem.gateway.encoders import gateway_encoder
from tandem.gateway.middlewares import GATEWAY_CUT

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, send

NOWHERE = "127.0.0.1:9"  # nothing listens: the decoder's health is 503
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def traced() -> AsyncIterator[tuple[TestClient, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-openai", [SimpleSpanProcessor(exporter)])
    config = GatewayConfig(decoder_address=NOWHERE, encoder_address=NOWHERE, port=0)
    encoder = gateway_encoder(config)
    callers = decoder_channels(config)
    workers = BodyWorkers(1)
    # Its start does not wait for a decoder that never serves (FIRST_HEALTH_S).
    gateway = Gateway(config, encoder, callers, workers, tracer=telemetry.tracer, first_health_s=0.0)
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()
    try:
        yield client, exporter
    finally:
        await client.close()
        await gateway.close()
        await callers.close()
        workers.close()
        await encoder.close()


async def _until(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    """The span ends once the cancelled handler has unwound: poll rather than race it."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def _only(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = exporter.get_finished_spans()
    exporter.clear()
    return span


async def test_a_span_is_named_by_the_route_not_the_path_and_a_5xx_is_an_error(traced) -> None:
    client, exporter = traced
    response = await client.get("/v1/models/" + "m" * 7000)
    assert response.status == 503  # no decoder to ask
    span = _only(exporter)
    assert span.name == "GET /v1/models/{model}" and span.attributes["http.route"] == "/v1/models/{model}"
    assert span.attributes["http.response.status_code"] == 503
    assert (span.attributes["http.request.method"], span.attributes["error.type"]) == ("GET", "503")
    assert span.attributes["url.path"] == ("/v1/models/" + "m" * 7000)[: otel.MAX_ATTRIBUTE_CHARS]
    assert span.attributes["client.address"] == "127.0.0.1"
    assert not [k for k in span.attributes if k in ("http.method", "http.status_code", "http.target")]
    assert span.status.status_code is StatusCode.ERROR


async def test_a_path_no_route_matches_is_named_by_its_method_alone_and_a_4xx_is_no_error(traced) -> None:
    # Each unknown path had its own span name (a 7 KB path, a 7 KB name), and a 404 or 405 was ERROR.
    client, exporter = traced
    for path, status in (("/" + "x" * 7000, 404), ("/v1/chat/completions", 405)):
        response = await client.get(path)
        assert response.status == status
        span = _only(exporter)
        assert span.name == "GET" and "http.route" not in span.attributes
        assert span.attributes["http.response.status_code"] == status
        assert span.status.status_code is StatusCode.UNSET


async def test_a_repeated_traceparent_is_no_parent(traced) -> None:
    client, exporter = traced
    await client.get("/nowhere", headers=[("traceparent", TRACEPARENT)])
    assert _only(exporter).parent.trace_id == int(TRACEPARENT.split("-")[1], 16)
    other = TRACEPARENT.replace("4736", "4737")
    await client.get("/nowhere", headers=[("traceparent", TRACEPARENT), ("traceparent", other)])
    assert _only(exporter).parent is None


async def test_a_caller_that_disconnects_mid_stream_leaves_the_status_unset_and_says_it_left() -> None:
    # No answer was refused: the caller went away. The span was ERROR, as a 5xx is, blaming the gateway.
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-openai", [SimpleSpanProcessor(exporter)])
    async with fake_decoder() as (decoder, address), live_gateway(address, tracer=telemetry.tracer) as url:
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{url}/completions", json={"prompt": "hang", "stream": True})
            assert response.status == 200
            await response.content.readline()
            response.close()  # the connection goes: the gateway's handler is cancelled
        await decoder.wait_until_none_open()
        await _until(lambda: [s for s in exporter.get_finished_spans() if s.name.startswith("POST")])
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    assert span.status.status_code is StatusCode.UNSET and "error.type" not in span.attributes
    assert span.attributes[otel.TANDEM_CALLER_DISCONNECTED] is True
    assert span.attributes["http.response.status_code"] == 200  # sent before it left


def _posts(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]


async def test_a_stream_the_gateways_shutdown_cuts_is_its_error_not_a_caller_that_left() -> None:
    # Past --grace-s aiohttp cancels the handler and closes the connection, its caller still reading: the
    # span said tandem.caller.disconnected, status unset.
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-openai", [SimpleSpanProcessor(exporter)])
    async with fake_decoder() as (decoder, address), aiohttp.ClientSession() as session:
        async with live_gateway(address, tracer=telemetry.tracer, grace_s=0.05) as url:
            response = await session.post(f"{url}/completions", json={"prompt": "hang", "stream": True})
            assert response.status == 200
            await response.content.readline()
        with pytest.raises(aiohttp.ClientPayloadError):  # cut by the gateway, mid-stream
            await response.content.read()
        await _until(lambda: _posts(exporter))
    (span,) = _posts(exporter)
    assert span.status.status_code is StatusCode.ERROR and span.status.description == GATEWAY_CUT
    assert otel.TANDEM_CALLER_DISCONNECTED not in span.attributes
    # The conventions' error.type for a request ended in error, and the 200 its head had been sent with:
    # the span had neither.
    assert span.attributes["error.type"] == "tandem.gateway_cut"
    assert span.attributes["http.response.status_code"] == 200


async def test_a_stream_its_write_timeout_cuts_is_the_gateways_error_not_a_caller_that_left() -> None:
    # The caller reads nothing and keeps its connection: the gateway aborts it after --write-timeout-s.
    exporter = InMemorySpanExporter()
    telemetry = otel.build_telemetry("tandem-openai", [SimpleSpanProcessor(exporter)])
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, tracer=telemetry.tracer, write_timeout_s=0.2) as url,
    ):
        sock = await connect(url, receive_buffer_bytes=4096)
        try:
            body = json.dumps({"prompt": "flood", "stream": True}).encode()
            await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await _until(lambda: _posts(exporter))
        finally:
            sock.close()
    (span,) = _posts(exporter)
    assert span.status.status_code is StatusCode.ERROR and span.status.description == GATEWAY_CUT
    assert otel.TANDEM_CALLER_DISCONNECTED not in span.attributes
    # The conventions' error.type for a request ended in error, and the 200 its head had been sent with:
    # the span had neither.
    assert span.attributes["error.type"] == "tandem.gateway_cut"
    assert span.attributes["http.response.status_code"] == 200
