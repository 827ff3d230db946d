"""A gateway over one decoder address answers from its watch of that decoder, as over several: /health
at once, and where the decoder does not serve, /v1/models and completions a 503 of the gateway's own at
once. Asked live, a decoder that accepted connections and said nothing held /health 2 s, /v1/models
10 s, and a completion 5.4 s for gRPC's "connection attempt timed out before receiving SETTINGS frame"."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from grpc_health.v1 import health_pb2

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway

PROMPT = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}
# An answer that came from the gateway's watch, not a call waiting on the decoder.
AT_ONCE_S = 0.5


@contextlib.asynccontextmanager
async def blackhole() -> AsyncIterator[str]:
    """An address that accepts connections and never says a byte (a process stopped after it listened)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


@contextlib.asynccontextmanager
async def nothing_listening() -> AsyncIterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: connections refused


async def _timed(
    http: aiohttp.ClientSession, method: str, url: str, **kwargs: object
) -> tuple[int, dict, float]:
    start = time.perf_counter()
    async with http.request(method, url, **kwargs) as response:
        return response.status, await response.json(), time.perf_counter() - start


@pytest.mark.parametrize(
    "not_serving", [blackhole, nothing_listening], ids=["blackhole", "nothing listening"]
)
async def test_a_decoder_that_does_not_serve_is_a_503_at_once_from_every_route(not_serving) -> None:
    async with (
        not_serving() as address,
        live_gateway(address, first_health_s=0.0) as url,  # it never serves: no start waits for it
        aiohttp.ClientSession() as http,
    ):
        base = url.removesuffix("/v1")
        for _ in range(2):
            status, body, took_s = await _timed(http, "GET", base + "/health")
            assert (status, body["status"], body["replicas"]) == (
                503,
                "unavailable",
                {"serving": 0, "watched": 1},
            )
            assert took_s < AT_ONCE_S
        for method, path, kwargs in [
            ("GET", "/models", {}),
            ("GET", "/models/fake-model", {}),
            ("POST", "/completions", {"json": PROMPT}),
            (
                "POST",
                "/chat/completions",
                {"json": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}},
            ),
        ]:
            status, body, took_s = await _timed(http, method, url + path, **kwargs)
            assert status == 503 and took_s < AT_ONCE_S, (path, took_s)
            assert body["error"]["message"].startswith("no decoder replica serves now"), body


async def test_one_decoder_s_health_is_its_watch_s_both_ways() -> None:
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address) as url,
        aiohttp.ClientSession() as http,
    ):
        base = url.removesuffix("/v1")
        status, body, _ = await _timed(http, "GET", base + "/health")
        assert (status, body) == (200, {"status": "ok", "replicas": {"serving": 1, "watched": 1}})
        await decoder.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # its engine failed
        await asyncio.sleep(0.1)  # the watch hears it
        status, body, took_s = await _timed(http, "GET", base + "/health")
        assert status == 503 and took_s < AT_ONCE_S
        status, body, took_s = await _timed(http, "POST", url + "/completions", json=PROMPT)
        # It said its model while it served: the replicas' own 503, naming it.
        assert status == 503 and body["error"]["message"].startswith("no decoder replica serves model")
        await decoder.set_health(health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.3)  # the watch asks again within MIN_RETRY_S, then hears it
        status, body, _ = await _timed(http, "POST", url + "/completions", json=PROMPT)
        assert status == 200, body


async def test_a_dns_name_that_does_not_resolve_is_said_so_in_the_503() -> None:
    """It said "none of the 0 watched ... says it serves (loading, stopped, or not answering)": the
    name is what is wrong, and gRPC's own error had named the DNS failure."""
    async with (
        live_gateway("dns:///no-such-host.invalid:50052", first_health_s=0.0) as url,
        aiohttp.ClientSession() as http,
    ):
        for method, path, kwargs in [("GET", "/models", {}), ("POST", "/completions", {"json": PROMPT})]:
            status, body, took_s = await _timed(http, method, url + path, **kwargs)
            message = body["error"]["message"]
            assert status == 503 and took_s < AT_ONCE_S, (path, took_s)
            assert "dns:///no-such-host.invalid:50052 does not resolve (yet)" in message, message
        status, body, _ = await _timed(http, "GET", url.removesuffix("/v1") + "/health")
        assert (status, body["replicas"]) == (503, {"serving": 0, "watched": 0})
