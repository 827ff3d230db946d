"""Large bodies are shared between callers, over raw sockets: a head alone holds no place among
--max-large-bodies, however large the length it declares; a caller holds at most
--max-large-bodies-per-caller places (429 naming the flag beyond), so what one caller holds open, by
bodies it never finishes, leaves another caller's large body served at once; and a caller's places
come back when its connections close."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, send

LARGE = 1024  # --large-body-bytes of these tests
IDLE_S = 5.0  # --body-idle-timeout-s: a held body outlives each test unless its connection closes
BODY = json.dumps({"prompt": "x" * 2 * LARGE, "max_tokens": 1}).encode()  # a large body


def _head(token: str, length: int, close: bool = False) -> bytes:
    closing = b"Connection: close\r\n" if close else b""
    return COMPLETIONS_HEAD + b"Authorization: Bearer %s\r\nContent-Length: %d\r\n%s\r\n" % (
        token.encode(),
        length,
        closing,
    )


async def _large_body(url: str, token: str) -> tuple[int, dict, float]:
    """A whole large body of `token`'s on a new connection: its answer and the seconds it took."""
    started = time.monotonic()
    sock = await connect(url)
    try:
        await send(sock, _head(token, len(BODY), close=True) + BODY)
        status, answer = await read_answer(sock, 10)
    finally:
        sock.close()
    return status, answer, time.monotonic() - started


async def _served_at_once(url: str, token: str) -> None:
    """`token`'s large body is answered, not refused, within a second."""
    status, answer, took_s = await _large_body(url, token)
    assert status == 200, answer
    assert answer["choices"][0]["text"].startswith("<xx") and took_s < 1


@pytest.fixture
async def url() -> AsyncIterator[str]:
    """A gateway of 2 large-body places, 1 a caller; callers told apart by their tokens (all of these
    come from one address)."""
    async with (
        fake_decoder() as (_, address),
        live_gateway(
            address,
            auth_tokens=frozenset({"a", "b"}),
            large_body_bytes=LARGE,
            max_large_bodies=2,
            max_large_bodies_per_caller=1,
            body_idle_timeout_s=IDLE_S,
            body_timeout_s=IDLE_S,
        ) as url,
    ):
        status, _, _ = await _large_body(url, "a")  # the body worker started (a second to import)
        assert status == 200
        yield url


async def test_heads_alone_hold_no_place_however_large_the_length_they_declare(url: str) -> None:
    held = [await connect(url) for _ in range(3)]  # more heads than places, each declaring a large body
    try:
        for sock in held:
            await send(sock, _head("a", 10 * LARGE))
        await asyncio.sleep(0.2)  # the gateway has read the heads and waits on their bodies
        for token in ("a", "b"):  # the heads' own caller, and another, are both served at once
            await _served_at_once(url, token)
    finally:
        for sock in held:
            sock.close()


async def test_a_caller_holding_its_share_leaves_another_callers_large_body_served_at_once(url: str) -> None:
    """Caller a starts as many large bodies as there are places and sends only their first bytes: the
    first holds a's one place, the second is refused 429 naming the flag, and b's large body is served
    while a's stays held."""
    held = [await connect(url) for _ in range(2)]
    try:
        for sock in held:
            await send(sock, _head("a", len(BODY)) + BODY[:100])
        await asyncio.sleep(0.2)  # the gateway has read their first bytes
        await _served_at_once(url, "b")
        status, answer = await read_answer(held[1], 1)
        assert status == 429 and answer["error"]["type"] == "rate_limit_error"
        assert "--max-large-bodies-per-caller" in answer["error"]["message"]
        status, answer, _ = await _large_body(url, "a")  # a is still at its share
        assert status == 429 and "--max-large-bodies-per-caller" in answer["error"]["message"]
    finally:
        for sock in held:
            sock.close()


async def test_a_callers_places_come_back_when_its_connections_close(url: str) -> None:
    sock = await connect(url)
    await send(sock, _head("a", len(BODY)) + BODY[:100])
    await asyncio.sleep(0.2)
    assert (await _large_body(url, "a"))[0] == 429
    sock.close()  # the handler is cancelled, its place given back
    async with asyncio.timeout(2):
        while (status := (await _large_body(url, "a"))[0]) == 429:
            await asyncio.sleep(0.05)
    assert status == 200
