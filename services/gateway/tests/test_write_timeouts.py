"""A caller that stops reading its answer while its connection stays open, over a raw socket with a
small receive buffer: once it has taken nothing for --write-timeout-s, its connection is closed, its
request's decoder calls are cancelled and one line names the flag; a neighbour streams on."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import aiohttp
import pytest

from tandem.gateway.connections import NUM_WRITE_LOOKS, _Writes

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, read_to_close, send, unread_answer

WRITE_TIMEOUT_S = 0.5  # --write-timeout-s of these tests
NUM_CHOICES = 4  # the unread stream's choices: each a decoder call streaming until it is cancelled


async def _unread_stream(url: str) -> socket.socket:
    """A connection that asks for a stream of `flood` choices and then reads nothing: a receive buffer
    of a few KiB, so the gateway's writes back up at once."""
    sock = await connect(url, receive_buffer_bytes=4096)
    body = json.dumps({"prompt": "flood", "n": NUM_CHOICES, "stream": True}).encode()
    await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def _next_event(response: aiohttp.ClientResponse) -> bytes:
    while not (line := await response.content.readline()).startswith(b"data: "):
        assert line == b"\n", line
    return line


async def test_a_caller_that_stops_reading_is_closed_its_decoder_calls_cancelled_and_a_neighbour_streams_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, write_timeout_s=WRITE_TIMEOUT_S) as url,
        aiohttp.ClientSession() as session,
        session.post(f"{url}/completions", json={"prompt": "hang neighbour", "stream": True}) as neighbour,
    ):
        await _next_event(neighbour)  # the neighbour streams
        with caplog.at_level(logging.INFO):
            sock = await _unread_stream(url)
            try:
                async with asyncio.timeout(5):
                    while decoder.num_open < 1 + NUM_CHOICES:
                        await asyncio.sleep(0.01)
                started = time.monotonic()
                async with asyncio.timeout(10):  # the buffers fill, then --write-timeout-s passes
                    while decoder.num_open > 1:
                        await asyncio.sleep(0.01)
                took_s = time.monotonic() - started
                await read_to_close(sock, 5)  # the gateway closed it
            finally:
                sock.close()
        unread = [r.request_id for r in decoder.requests if "neighbour" not in r.prompt[0].text]
        assert sorted(decoder.cancelled) == sorted(unread) and len(unread) == NUM_CHOICES
        assert WRITE_TIMEOUT_S <= took_s < 5, took_s
        [line] = [r.getMessage() for r in caplog.records if "--write-timeout-s" in r.getMessage()]
        assert "took none of its answer for 0.5 s (--write-timeout-s)" in line and "127.0.0.1:" in line
        gateway_errors = [r for r in caplog.records if r.name.startswith(("aiohttp", "tandem"))]
        assert [r.getMessage() for r in gateway_errors if r.levelno >= logging.WARNING] == []
        for _ in range(20):  # the neighbour's stream goes on, its call open
            assert (await _next_event(neighbour)).startswith(b"data: {")
        assert decoder.num_open == 1 and len(decoder.cancelled) == NUM_CHOICES


ANSWER_PROMPT_CHARS = 40_000  # an answer of ~40 KiB: past the kernel's ~8 KiB, under aiohttp's 64 KiB


async def _unread_answer(url: str, close: bool) -> socket.socket:
    """A connection that asks for a whole answer of ~40 KiB (the fake echoes its prompt) and then reads
    nothing; with `close`, a Connection: close request, else a keep-alive one."""
    sock = await connect(url, receive_buffer_bytes=2048)
    body = json.dumps({"prompt": "a" * ANSWER_PROMPT_CHARS, "max_tokens": 2}).encode()
    head = COMPLETIONS_HEAD + (b"Connection: close\r\n" if close else b"")
    await send(sock, head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def test_an_unread_answer_under_the_high_water_mark_frees_its_connection_after_the_write_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The answer's handler ends with ~32 KiB unsent, under the mark at which aiohttp pauses writing;
    # aiohttp's close (Connection: close, or the keep-alive timeout) then waited for them for ever, both
    # connections held: every other caller was refused 503 (--max-connections 2).
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(
            address,
            send_buffer_bytes=4096,
            write_timeout_s=WRITE_TIMEOUT_S,
            idle_timeout_s=WRITE_TIMEOUT_S,
            max_connections=2,
        ) as url,
        aiohttp.ClientSession() as session,
    ):
        with caplog.at_level(logging.INFO):
            socks = [await _unread_answer(url, close=True), await _unread_answer(url, close=False)]
            try:
                async with asyncio.timeout(5):
                    while len(decoder.requests) < 2:
                        await asyncio.sleep(0.01)
                started = time.monotonic()
                statuses = []
                async with asyncio.timeout(5):  # a neighbour retries until a connection is free
                    while not statuses or statuses[-1] == 503:
                        async with session.get(f"{url}/models") as neighbour:
                            statuses.append(neighbour.status)
                        await asyncio.sleep(0.05)
                took_s = time.monotonic() - started
                sent = [await read_to_close(sock, 5) for sock in socks]  # the gateway closed them
            finally:
                for sock in socks:
                    sock.close()
        assert statuses[0] == 503 and statuses[-1] == 200, statuses
        assert WRITE_TIMEOUT_S <= took_s < 5, took_s
        assert all(0 < len(s) < ANSWER_PROMPT_CHARS for s in sent), [len(s) for s in sent]
        lines = [r.getMessage() for r in caplog.records if "--write-timeout-s" in r.getMessage()]
        assert len(lines) == 2 and all("took none of its answer for 0.5 s" in line for line in lines)


async def test_a_caller_reading_slowly_is_never_cut() -> None:
    # It takes 64 KiB every 0.1 s of a stream that writes as fast as it may, for three times the bound,
    # through loopback's own buffers: the kernel holds MiBs of the answer, so the bytes the gateway
    # holds unsent went down only once about half of those were taken, and it was cut in 0.5 s.
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, write_timeout_s=WRITE_TIMEOUT_S) as url,
    ):
        sock = await connect(url, receive_buffer_bytes=4096)
        try:
            body = json.dumps({"prompt": "flood", "stream": True}).encode()
            await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            loop, received = asyncio.get_running_loop(), 0
            until = time.monotonic() + 3 * WRITE_TIMEOUT_S
            while time.monotonic() < until:
                async with asyncio.timeout(5):
                    chunk = await loop.sock_recv(sock, 65536)
                assert chunk, f"closed after {received} bytes"
                received += len(chunk)
                await asyncio.sleep(0.1)
            assert decoder.num_open == 1 and decoder.cancelled == []
        finally:
            sock.close()


async def test_answers_cut_for_the_write_timeout_give_their_callers_choices_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A caller's answers being written are bounded (twice --max-streams-per-caller, in choices); each
    # is given back when its connection is cut, or the caller that never read was refused for ever.
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, send_buffer_bytes=4096, max_streams_per_caller=8, write_timeout_s=0.5) as url,
    ):
        caplog.set_level(logging.INFO)
        for round_ in range(2):  # the bound whole again after the first two were cut
            socks = [await unread_answer(url), await unread_answer(url)]  # 16 choices being written
            try:
                body = json.dumps({"prompt": "q"}).encode()
                sock = await connect(url)
                await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                status, answer = await read_answer(sock, 5)
                sock.close()
                assert status == 429 and "twice --max-streams-per-caller" in answer["error"]["message"]
                async with asyncio.timeout(5):  # the gateway cuts them (its FIN queued behind the answer)
                    while len(_cuts(caplog)) < 2 * (1 + round_):
                        await asyncio.sleep(0.05)
            finally:
                for sock in socks:
                    sock.close()


def _cuts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "(--write-timeout-s)" in r.getMessage()]


class _Unsent(asyncio.WriteTransport):
    """A transport holding `unsent` bytes, on a system that counts no acknowledged bytes (no socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.unsent = 0

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def _looks(writes: _Writes, transport: _Unsent, unsent: list[int]) -> list[bool]:
    result = []
    for n in unsent:
        transport.unsent = n
        result.append(writes.look())
    return result


def test_without_a_count_of_acknowledged_bytes_unsent_bytes_that_do_not_go_down_are_a_stall() -> None:
    transport = _Unsent()
    writes = _Writes(transport)
    # Bytes left unsent and never taken: the fourth look after the last change.
    assert _looks(writes, transport, [900, 900, 900, 900, 900]) == [False] * NUM_WRITE_LOOKS + [True]
    # Fewer unsent is bytes taken; more while writing is not paused is the handler writing: both
    # start the count again, as does nothing unsent.
    writes = _Writes(transport)
    assert not any(_looks(writes, transport, [900, 900, 900, 800, 800, 800, 1500, 1500, 1500, 0, 0, 0, 0]))


def test_without_a_count_of_acknowledged_bytes_more_unsent_with_writing_paused_throughout_is_none_taken() -> (
    None
):
    transport = _Unsent()
    writes = _Writes(transport)
    writes.pause()
    # The look that saw the pause begin counts from there; then each grows, paused since the last.
    assert _looks(writes, transport, [70_000, 80_000, 90_000, 100_000, 110_000]) == [False] * 4 + [True]
    writes = _Writes(transport)
    writes.pause()
    assert _looks(writes, transport, [70_000, 80_000, 90_000]) == [False] * 3
    writes.resume()  # under the low-water mark since: bytes were taken, though more are unsent now
    writes.pause()
    assert _looks(writes, transport, [100_000, 110_000, 120_000, 130_000]) == [False] * 4
