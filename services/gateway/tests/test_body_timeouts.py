"""Bodies that never finish arriving, over a raw socket: a chunk size that never comes, a body that
stops mid-way on an open connection, a body trickled a byte at a time, a body that cannot be decoded.
Each is answered (408 naming --body-idle-timeout-s or --body-timeout-s, or 400) as soon as its bound
passes, its connection closed right after the answer, before any call reaches the decoder; a body
that pauses for less than the idle bound is served, and the gateway serves on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator

import pytest

from .fake_decoder import FakeDecoder, fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, parse_answer, read_to_close, send

IDLE_S = 0.5  # --body-idle-timeout-s of these tests
HEAD = COMPLETIONS_HEAD
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
BODY = b'{"prompt": "hi", "max_tokens": 1}'


async def _answer(sock: socket.socket, within_s: float) -> tuple[int, dict, float]:
    """The status and JSON of the answer, and the seconds until the server closed the connection, which
    its head announced (`Connection: close`: a client that reused it would fail its next request)."""
    started = time.monotonic()
    sent = await read_to_close(sock, within_s)
    assert b"\r\nconnection: close\r\n" in sent.partition(b"\r\n\r\n")[0].lower() + b"\r\n", sent[:300]
    status, answer = parse_answer(sent)
    sock.close()
    return status, answer, time.monotonic() - started


async def _serves(url: str) -> None:
    """A whole body on a new connection is answered 200."""
    sock = await connect(url)
    await send(sock, HEAD + b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
    status, answer, _ = await _answer(sock, 5)
    assert status == 200 and answer["choices"][0]["text"] == "<hi>"


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[FakeDecoder, str]]:
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, body_idle_timeout_s=IDLE_S, body_timeout_s=30.0) as url,
    ):
        yield decoder, url


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(CHUNKED, id="a chunk size that never comes"),
        pytest.param(CHUNKED + b'40\r\n{"prompt": ', id="a chunk that stops mid-way"),
        pytest.param(CHUNKED + b"4\r\n" + BODY[:4] + b"\r\n", id="chunks without their last"),
        pytest.param(HEAD + b"Content-Length: 100\r\n\r\n" + BODY[:10], id="fewer bytes than Content-Length"),
    ],
)
async def test_a_body_that_stalls_is_408_after_the_idle_bound_and_its_connection_closed(
    gateway: tuple[FakeDecoder, str], sent: bytes
) -> None:
    decoder, url = gateway
    sock = await connect(url)
    await send(sock, sent)
    status, answer, took_s = await _answer(sock, IDLE_S + 5)  # the whole-body bound is 30 s
    assert status == 408 and answer["error"]["param"] == "body"
    assert "sent nothing for 0.5 s (--body-idle-timeout-s)" in answer["error"]["message"]
    assert IDLE_S <= took_s < IDLE_S + 2
    assert decoder.requests == [] and decoder.num_open == 0  # no Generate call was made
    await _serves(url)


async def test_a_trickled_body_is_cut_at_the_whole_body_bound_and_closed_at_once() -> None:
    """Bytes every 0.1 s keep the idle bound from passing; the whole-body bound cuts the body, and the
    connection closes with the answer rather than after aiohttp's lingering (10 s here, to tell them
    apart) on the trickle."""
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, lingering_s=10.0, body_idle_timeout_s=IDLE_S, body_timeout_s=1.0) as url,
    ):
        sock = await connect(url)
        await send(sock, CHUNKED)

        async def trickle() -> None:
            with contextlib.suppress(OSError):  # until the gateway closes the connection
                while True:
                    await asyncio.sleep(0.1)
                    await send(sock, b"1\r\n \r\n")

        trickling = asyncio.ensure_future(trickle())
        try:
            status, answer, took_s = await _answer(sock, 5)
        finally:
            trickling.cancel()
        assert status == 408 and answer["error"]["param"] == "body"
        assert "was not whole within 1 s (--body-timeout-s)" in answer["error"]["message"]
        assert 1.0 <= took_s < 3
        assert decoder.requests == []
        await _serves(url)


async def test_a_body_pausing_for_less_than_the_idle_bound_is_served(
    gateway: tuple[FakeDecoder, str],
) -> None:
    _, url = gateway
    sock = await connect(url)
    await send(sock, CHUNKED.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n"))
    for i in range(0, len(BODY), 12):  # 3 pauses of 0.3 s: 0.9 s in all, past the idle bound
        piece = BODY[i : i + 12]
        await send(sock, b"%x\r\n%s\r\n" % (len(piece), piece))
        await asyncio.sleep(0.3)
    await send(sock, b"0\r\n\r\n")
    status, answer, _ = await _answer(sock, 5)
    assert status == 200 and answer["choices"][0]["text"] == "<hi>"


async def test_a_body_that_cannot_be_decoded_is_400_closed_and_logs_no_traceback(
    gateway: tuple[FakeDecoder, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Not gzip, though it says so: the caller's fault, answered as such, not logged as the server's."""
    decoder, url = gateway
    sock = await connect(url)
    with caplog.at_level(logging.ERROR):
        await send(sock, HEAD + b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\nabcde")
        status, answer, took_s = await _answer(sock, 5)
        await _serves(url)
    assert status == 400 and answer["error"]["param"] == "body"
    assert "Content-Encoding: gzip" in answer["error"]["message"] and took_s < 1
    assert decoder.requests[0].prompt[0].text == "hi" and len(decoder.requests) == 1  # _serves' only
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_chunk_size_that_is_not_hex_after_chunks_that_were_is_400_at_once_and_closed(
    gateway: tuple[FakeDecoder, str], caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's C parser told its protocol, not the body being read: the handler waited for the idle
    bound and answered 408."""
    decoder, url = gateway
    sock = await connect(url)
    with caplog.at_level(logging.ERROR):
        await send(sock, CHUNKED + b"%x\r\n%s\r\n" % (len(BODY), BODY))
        await asyncio.sleep(0.1)  # the handler reads the body's first chunk and waits for more
        await send(sock, b"zz\r\n")
        status, answer, took_s = await _answer(sock, IDLE_S + 5)
        await _serves(url)
    assert status == 400 and answer["error"]["param"] == "body" and took_s < IDLE_S
    assert "the body could not be read as sent: Invalid character in chunk size" in answer["error"]["message"]
    assert len(decoder.requests) == 1  # _serves' only
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
