"""Many callers at once, some of them hostile: one leaves mid-stream, one leaves while its choices are
collected, one while its picture is embedded, one stalls its body, one sends what is not JSON, one asks
a choice that fails mid-stream. The good callers' answers are the answers each gets alone, and once the
hostile ones are gone nothing of theirs is left: no decoder stream, no encoder call, no gateway task."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable

import aiohttp

from .fake_decoder import FakeDecoder, fake_decoder, prompt_text
from .fake_encoder import fake_encoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_to_close, send

NUM_GOOD = 12
COLLECTED = {"prompt": "hang collect", "n": 2}  # answered once all its choices end: never
FAILING = {"prompt": ["hang", "break"], "stream": True}  # "break" fails mid-stream, "hang" is cancelled
PICTURE = "data:image/png;base64," + base64.b64encode(b"\x89PNG picture").decode()


async def _good(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    """A streamed completion of its own prompt and seed: its status and its text."""
    body = {"prompt": f"p{i}", "max_tokens": 6, "seed": i, "stream": True}
    async with session.post(f"{url}/completions", json=body) as response:
        events = (await response.text()).split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    return response.status, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def _leave_mid_stream(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/completions", json={"prompt": "hang", "n": 3, "stream": True})
        await response.content.readline()  # its first event: the choices are streaming
        response.close()


async def _leave_once(url: str, path: str, body: dict, is_reached: Callable[[], bool]) -> None:
    """Posts `body` and leaves (closes its connection) once `is_reached()`: its calls are under way."""
    async with aiohttp.ClientSession() as session:
        posted = asyncio.ensure_future(session.post(url + path, json=body))
        async with asyncio.timeout(5):
            while not is_reached():
                await asyncio.sleep(0.005)
        posted.cancel()


def _num_streams(decoder: FakeDecoder, word: str) -> int:
    """The Generate streams the decoder was asked for prompts holding `word`."""
    return sum(word in prompt_text(request) for request in decoder.requests)


async def _stall_body(url: str) -> None:
    sock = await connect(url)
    await send(sock, COMPLETIONS_HEAD + b"Content-Length: 100\r\n\r\n{")
    await read_to_close(sock, 5)  # the gateway's 408, then its close
    sock.close()


async def _status(session: aiohttp.ClientSession, url: str, **post: object) -> int:
    async with session.post(url, **post) as response:
        await response.read()
        return response.status


def _gateway_tasks() -> list[asyncio.Task]:
    """The loop's tasks but the fake services' (gRPC's server keeps tasks waiting for calls)."""
    return [t for t in asyncio.all_tasks() if "AioServer" not in repr(t)]


async def test_hostile_neighbours_change_no_answer_and_leave_nothing_behind() -> None:
    async with fake_encoder() as (encoder, encoder_address), fake_decoder() as (decoder, address):
        async with live_gateway(address, encoder_address=encoder_address, body_idle_timeout_s=0.5) as url:
            num_tasks = len(_gateway_tasks())
            async with aiohttp.ClientSession() as session:
                alone = [await _good(session, url, i) for i in range(NUM_GOOD)]
            picture = {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PICTURE}}]}
                ]
            }
            async with aiohttp.ClientSession() as session:
                together = await asyncio.gather(
                    *(_good(session, url, i) for i in range(NUM_GOOD)),
                    _leave_mid_stream(url),
                    _leave_once(url, "/completions", COLLECTED, lambda: _num_streams(decoder, "hang c") == 2),
                    _leave_once(url, "/chat/completions", picture, lambda: len(encoder.embedded) == 1),
                    _stall_body(url),
                    _status(session, f"{url}/completions", data=b'{"prompt": '),
                    _status(session, f"{url}/completions", json=FAILING),
                )  # fmt: skip
            await decoder.wait_until_none_open()
            async with asyncio.timeout(2):  # each connection's handler ends as its close arrives
                while len(_gateway_tasks()) > num_tasks:
                    await asyncio.sleep(0.01)
    assert together[:NUM_GOOD] == alone and all(status == 200 for status, _ in alone)
    assert together[-2:] == [400, 200]  # the failing choice ends its own stream with an error event
    # Every stream ended (wait_until_none_open), the "hang" ones (3 left mid-stream, 2 collected, break's
    # neighbour) only as they were cancelled: they never finish. (The fake's `cancelled` list can miss a
    # stream cancelled while gRPC, not the stream, was waiting: its count is not asserted.)
    assert sum("hang" in prompt_text(r) for r in decoder.requests) == 3 + 2 + 1
    assert encoder.num_cancelled == 1
