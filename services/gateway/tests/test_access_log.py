"""What `tandem serve openai` logs: its start line names the decoder and the encoder it serves in front
of, and its access log has a line for each request except a health probe that succeeds (the probes of
`tandem up`, `tandem wait`, compose and Kubernetes); a probe that fails is logged, unless it is Tandem's
own readiness probe, which says itself what it was told. What a caller chose (its path, its User-Agent)
is written escaped, in the access line and in the line of a request that failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from grpc_health.v1 import health_pb2

from tandem.gateway.__main__ import serve
from tandem.gateway.access_log import AccessLog
from tandem.gateway.app import FIRST_HEALTH_S, Gateway
from tandem.gateway.config import GatewayConfig
from tandem.readiness import PROBE_USER_AGENT, Probe

from .fake_decoder import FakeDecoder, fake_decoder
from .live_gateway import live_gateway
from .raw_http import connect, read_answer, send

ENCODER = "127.0.0.1:9"  # no encoder listens: these requests never reach one


@contextlib.asynccontextmanager
async def served(decoder_address: str, first_health_s: float = FIRST_HEALTH_S) -> AsyncIterator[str]:
    """The gateway as `tandem serve openai` serves it (its `serve`), on this loop: its base URL. Once
    this ends, the gateway has stopped, every request's access line written. `first_health_s`: how
    long its start waits for the decoder to serve (0 where it will not: it waited 1 s)."""
    config = GatewayConfig(decoder_address=decoder_address, encoder_address=ENCODER, port=0, body_workers=1)
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(config, ready, first_health_s))
    try:
        yield f"http://127.0.0.1:{await asyncio.wait_for(ready, 30)}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]


async def test_the_start_line_names_the_decoder_and_the_encoder(caplog: pytest.LogCaptureFixture) -> None:
    async with fake_decoder() as (_, address):
        with caplog.at_level(logging.INFO, logger="tandem.gateway"):
            async with served(address):
                pass
    [start] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving the OpenAI API")]
    assert f"(decoder {address}, encoder {ENCODER})" in start


async def test_health_probes_that_succeed_write_no_access_line_and_every_other_request_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    decoder: FakeDecoder
    async with fake_decoder() as (decoder, address):
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            async with served(address) as url, aiohttp.ClientSession() as http:
                statuses = []
                for method, path in [("GET", "/health"), ("HEAD", "/health"), ("GET", "/health?probe=1")]:
                    async with http.request(method, url + path) as response:
                        statuses.append(response.status)
                async with http.get(url + "/v1/models") as response:
                    statuses.append(response.status)
                async with http.get(url + "/nowhere") as response:
                    statuses.append(response.status)
                await decoder.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                await asyncio.sleep(0.1)  # the gateway's watch hears it (a Watch's next message)
                async with http.get(url + "/health") as response:
                    statuses.append(response.status)
    assert statuses == [200, 200, 200, 200, 404, 503]
    lines = access_lines(caplog)
    assert len(lines) == 3, lines
    assert '"GET /v1/models HTTP/1.1" 200' in lines[0]
    assert '"GET /nowhere HTTP/1.1" 404' in lines[1]
    assert '"GET /health HTTP/1.1" 503' in lines[2]


async def test_the_503s_that_tandem_waits_own_probe_is_told_while_the_decoder_loads_write_no_access_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    decoder: FakeDecoder
    async with fake_decoder() as (decoder, address):
        await decoder.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # still loading
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            async with served(address, first_health_s=0.0) as url, aiohttp.ClientSession() as http:
                probe = Probe([url + "/health"])  # what `tandem wait` and `tandem up` ask with
                said = [await asyncio.to_thread(probe.not_serving, url + "/health") for _ in range(3)]
                async with http.get(url + "/health") as response:  # any other prober
                    other = response.status
                # The User-Agent is the caller's to choose: it quiets a 503 to a GET, nothing else.
                as_probe = {"User-Agent": PROBE_USER_AGENT}
                async with http.post(url + "/health", headers=as_probe) as response:
                    posted = response.status
    assert said == ["HTTP 503"] * 3 and other == 503 and posted == 405
    [line, post] = access_lines(caplog)
    assert '"GET /health HTTP/1.1" 503' in line and "tandem-readiness" not in line
    assert '"POST /health HTTP/1.1" 405' in post


def test_the_access_line_escapes_what_the_caller_chose(caplog: pytest.LogCaptureFixture) -> None:
    # A `"` in a User-Agent ended its field, forging a status and size after it; U+0085 broke the line
    # where a shipper splits (Python's splitlines does), U+202E showed it reversed.
    headers = {"User-Agent": 'x" 200 99 "\u202e\x85y', "Referer": "a\\b"}
    request = make_mocked_request("GET", "/v1/a%0Ab", headers=headers)
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        AccessLog(logging.getLogger("aiohttp.access")).log(request, web.Response(status=404), 0.1)
    [line] = access_lines(caplog)
    assert line.endswith(
        '"GET /v1/a%0Ab HTTP/1.1" 404 0 "a\\x5Cb" "x\\x22 200 99 \\x22\\xE2\\x80\\xAE\\xC2\\x85y"'
    )
    assert line.isascii() and line.isprintable()


async def test_the_line_of_a_request_that_failed_holds_its_path_as_sent_escaped(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decoded, `%00` and `%E2%80%AE` put a NUL and a right-to-left override into the gateway's log (a
    # `%0A` matches no route: `{model:.+}` stops at a newline).
    async def fail(*_: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Gateway, "_model_cards", fail)
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        with caplog.at_level(logging.ERROR, logger="tandem.gateway"):
            sock = await connect(url)
            try:
                await send(sock, b"GET /v1/models/a%00b%E2%80%AE HTTP/1.1\r\nHost: x\r\n\r\n")
                status, _ = await read_answer(sock, 5)
            finally:
                sock.close()
    assert status == 500
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().endswith(" failed")]
    assert line == "GET /v1/models/a%00b%E2%80%AE failed"


async def test_the_access_line_holds_the_request_target_as_sent(caplog: pytest.LogCaptureFixture) -> None:
    # aiohttp's line holds the target's path and query: empty for a CONNECT (`"CONNECT  HTTP/1.1"`) and
    # for an absolute-form target with no path, its escapes decoded (a `%2F` read as a "/").
    targets = [b"CONNECT x:443", b"GET http://x?q=1", b"GET /v1/models/a%2Fb%20c"]
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            for target in targets:
                sock = await connect(url)
                try:
                    await send(sock, target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                    await read_answer(sock, 5)
                finally:
                    sock.close()
            await asyncio.sleep(0.05)  # the last line is written once its answer is
    lines = access_lines(caplog)
    assert [line.split('"')[1] for line in lines] == [t.decode() + " HTTP/1.1" for t in targets]
