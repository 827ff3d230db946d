"""Issue 49's attacks on the gateway, sent raw to `tandem serve openai` as a process in front of live
services: each ends 400/413 naming the field, /health keeps answering, and what a refused request
took comes back.

/health is probed from a thread every 100 ms with a 1 s deadline (the issue's prober); the test
asserts that no probe went unanswered, a count rather than a time. Time to the refusal is asserted
only against a generous 3 s (the issue's figures were 10-19 s; on an idle machine these take 0.1-0.4
s, docs/RELIABILITY.md), because a loaded 2-core CI machine may stretch any one of them. Memory is the
gateway's resident set with its worker processes (/proc), read after each refusal.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import io
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import torch

from tandem.common.server import ServerOptions
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.config import EncoderConfig
from tandem.encoder.lookup import LookupEmbedder
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.encoder.conftest import start_encoder, stop_encoder
from tests.integration.gateway.conftest import GatewayProcess, gateway_process

MIB = 1024 * 1024
JSON = {"Content-Type": "application/json"}
GENEROUS_S = 3.0  # a refusal's time on a loaded CI machine (0.1-0.4 s idle)
MAX_GROWTH_MB = 200  # the bound on what one refused request may leave behind
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16


class HealthProbe(threading.Thread):
    """GET /health every 100 ms with a 1 s deadline; counts the probes that got no answer in time."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.stop, self.num_answered, self.num_unanswered = port, threading.Event(), 0, 0
        self.longest_silence_s, self._last = 0.0, 0.0

    def run(self) -> None:
        self._last = time.monotonic()
        while not self.stop.is_set():
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
            try:
                connection.request("GET", "/health")
                connection.getresponse().read()
                self.num_answered += 1
                now = time.monotonic()
                self.longest_silence_s = max(self.longest_silence_s, now - self._last)
                self._last = now
            except OSError:
                self.num_unanswered += 1
            finally:
                connection.close()
            time.sleep(0.1)


@contextlib.asynccontextmanager
async def services_and_gateway(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, log: Path, *flags: str
) -> AsyncIterator[GatewayProcess]:
    """The decoder and an encoder of 8192 input tokens (the issue's 8,000-ID inputs fit) on this
    loop, the gateway as a process in front of them."""
    decoder = await serve(tiny_model_dir, tiny_fp32)
    config = EncoderConfig(
        model_dir=tiny_model_dir,
        max_input_tokens=8192,
        model_name="tiny-qwen3",
        server=ServerOptions(host="127.0.0.1", port=0, max_message_bytes=64 * MIB),
    )
    encoder = await start_encoder(config, LookupEmbedder.load(tiny_model_dir, torch.float32))
    addresses = ("--decoder-address", decoder.server.address, "--encoder-address", encoder.server.address)
    try:
        async with gateway_process(log, *addresses, *flags) as gateway:
            yield gateway
    finally:
        await stop_encoder(encoder)
        await shutdown(decoder)


def _chat_messages(n: int) -> bytes:
    message = b'{"role":"user","content":"hi"}'
    return b'{"model":"","messages":[' + message + (b"," + message) * (n - 1) + b"]}"


def _logit_bias(n: int) -> bytes:
    entries = ('"' + '":1.0,"'.join(map(str, range(n))) + '":1.0').encode()
    return b'{"model":"","messages":[{"role":"user","content":"hi"}],"logit_bias":{' + entries + b"}}"


def _token_ids(n: int) -> bytes:
    return b'{"model":"","prompt":[' + b"1," * (n - 1) + b"1]}"


def _embeddings(num_inputs: int, num_ids: int) -> bytes:
    ids = b"[" + b",".join([b"7"] * num_ids) + b"]"
    inputs = b",".join([ids] * num_inputs)
    return b'{"model":"","encoding_format":"base64","tandem_pooling":"none","input":[' + inputs + b"]}"


# (case, path, body, status, param): the attacks on the gateway (items 1 and 2).
CHAT, TEXT, EMBED = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ATTACKS = [
    ("3M chat messages (93 MB)", CHAT, lambda: _chat_messages(3_000_000), 400, "messages"),
    ("7M logit_bias entries (97 MB)", CHAT, lambda: _logit_bias(7_000_000), 400, "logit_bias"),
    ("40M token IDs (80 MB)", TEXT, lambda: _token_ids(40_000_000), 400, "prompt"),
    ("32 inputs of 8,000 IDs, rows asked (87 MB)", EMBED, lambda: _embeddings(32, 8000), 413, "input"),
]  # fmt: skip


async def test_wide_bodies_and_amplified_embeddings_are_refused_naming_the_field_while_health_answers(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    async with services_and_gateway(tiny_model_dir, tiny_fp32, tmp_path / "gateway.log") as gateway:
        probe = HealthProbe(gateway.port)
        async with aiohttp.ClientSession() as session:
            await _ok(session, gateway)  # warm: model info asked, workers up
            # Built before the probe starts: building blocks this loop, where the decoder answers health.
            bodies = [make_body() for _, _, make_body, _, _ in ATTACKS]
            two = _embeddings(32, 8000)
            start_mb = gateway.rss_mb()
            probe.start()
            for case, path, _, status, param in ATTACKS:
                body = bodies.pop(0)
                before_mb = gateway.rss_mb()
                started = time.monotonic()
                async with session.post(gateway.url + path, data=io.BytesIO(body), headers=JSON) as response:
                    error = (await response.json())["error"]
                took = time.monotonic() - started
                del body
                assert (response.status, error["param"]) == (status, param), (case, error)
                assert took < GENEROUS_S, (case, took)
                await _ok(session, gateway)  # and it keeps serving
                assert gateway.rss_mb() - before_mb < MAX_GROWTH_MB, case
            both = await asyncio.gather(
                *(session.post(gateway.url + EMBED, data=two, headers=JSON) for _ in range(2))
            )
            assert [r.status for r in both] == [413, 413]
            assert "--max-embeddings-bytes" in (await both[0].json())["error"]["message"]
            del two
        probe.stop.set()
        await asyncio.to_thread(probe.join, 5)  # not on this loop: the decoder answers health here
        assert probe.num_answered > 0 and probe.num_unanswered == 0, probe.longest_silence_s
        assert gateway.rss_mb() - start_mb < 100  # back within 100 MB of where the attacks began
    assert "Traceback" not in gateway.log.read_text()
    # Its start-up heap was frozen out of the collector's full passes (tandem.common.startup_heap).
    assert "start-up heap frozen" in gateway.log.read_text()


async def test_an_embeddings_answer_under_the_bound_is_the_encoders_rows_written_piece_by_piece(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    ids = [3 + i % 1000 for i in range(8000)]  # 8,000 rows of 64 floats: 2 MB, three base64 pieces
    body = {"model": "", "encoding_format": "base64", "tandem_pooling": "none", "input": [ids, "hello"]}
    async with (
        services_and_gateway(tiny_model_dir, tiny_fp32, tmp_path / "gateway.log") as gateway,
        aiohttp.ClientSession() as session,
        session.post(gateway.url + "/v1/embeddings", json=body) as response,
    ):
        assert response.status == 200 and response.content_length is not None
        answer = await response.json()
        assert len(await response.read()) == response.content_length
        pooled = []  # "hello" mean-pooled: base64 of the row's bytes, then JSON floats
        for encoding in ("base64", "float"):
            mean = {"model": "", "input": "hello", "tandem_pooling": "mean", "encoding_format": encoding}
            async with session.post(gateway.url + "/v1/embeddings", json=mean) as pooled_response:
                pooled.append((await pooled_response.json())["data"][0]["embedding"])
        # Serving took neither: the gateway is an HTTP front with no numerical library.
        assert gateway.mapped_packages("torch", "numpy") == set()
    mean_row = np.frombuffer(base64.b64decode(pooled[0]), dtype="<f4")
    assert pooled[1] == mean_row.tolist()  # JSON floats: the same row's values
    rows = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4").reshape(-1, 64)
    expected = tiny_fp32.model.embed_tokens.weight[torch.tensor(ids)].detach().float().numpy()
    np.testing.assert_array_equal(rows, expected)
    assert [d["index"] for d in answer["data"]] == [0, 1] and answer["usage"]["prompt_tokens"] > 8000


async def test_slow_clients_are_timed_out_and_connections_bounded(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    flags = (
        "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
        "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
    )  # fmt: skip
    async with services_and_gateway(tiny_model_dir, tiny_fp32, tmp_path / "gateway.log", *flags) as gateway:
        loop = asyncio.get_running_loop()
        # A connection that sends nothing, and one that trickles its head: both closed (EOF).
        silent = await _connect(gateway)
        trickler = await _connect(gateway)
        trickle = asyncio.ensure_future(_trickle(trickler, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"))
        assert await _closed_within(silent, HEADER_TIMEOUT_S + 5)
        assert await _closed_within(trickler, HEADER_TIMEOUT_S + 5)
        trickle.cancel()
        # A body that trickles: 408 naming the body, then closed.
        slow = await _connect(gateway)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        await loop.sock_sendall(slow, head + b"Content-Length: 1000\r\n\r\n{")
        reply = await _read_all(slow, BODY_TIMEOUT_S + 5)
        assert reply.startswith(b"HTTP/1.1 408") and b'"param": "body"' in reply, reply[:300]
        # Beyond --max-connections, each connection mid-request (its head read: `100 Continue` asked for
        # its body): 503 saying so, and the connections already open are unharmed. (One that waits for a
        # head would have given its place up: services/gateway/tests/test_connections.py.)
        held = [await _connect(gateway) for _ in range(MAX_CONNECTIONS)]
        expect = head + b"Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n"
        for sock in held:  # all heads first: each body's --body-timeout-s runs from its `100 Continue`
            await loop.sock_sendall(sock, expect)
        for sock in held:
            assert await _interim(sock) == b"HTTP/1.1 100 Continue\r\n\r\n"
        extra = await _connect(gateway)
        refused = await _read_all(extra, 5)
        assert refused.startswith(b"HTTP/1.1 503") and b"--max-connections" in refused
        for sock in held:
            sock.close()
        # Idle after a response: closed after --idle-timeout-s; the gateway serves on.
        idle = await _connect(gateway)
        await loop.sock_sendall(idle, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await loop.sock_recv(idle, 65536)).startswith(b"HTTP/1.1 ")
        assert await _closed_within(idle, IDLE_TIMEOUT_S + 5)
        async with aiohttp.ClientSession() as session:
            await _ok(session, gateway)


async def _ok(session: aiohttp.ClientSession, gateway: GatewayProcess) -> None:
    body = {"model": "", "prompt": "Once upon a time", "max_tokens": 2}
    async with session.post(gateway.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def _connect(gateway: GatewayProcess) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gateway.port))
    return sock


async def _interim(sock: socket.socket) -> bytes:
    """The interim answer `100 Continue` read whole (or what came before the connection closed)."""
    interim, sent = b"HTTP/1.1 100 Continue\r\n\r\n", b""
    async with asyncio.timeout(5):
        while len(sent) < len(interim) and (chunk := await asyncio.get_running_loop().sock_recv(sock, 1)):
            sent += chunk
    return sent


async def _trickle(sock: socket.socket, data: bytes) -> None:
    for i in range(len(data)):
        await asyncio.get_running_loop().sock_sendall(sock, data[i : i + 1])
        await asyncio.sleep(0.2)


async def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends until it closes the connection."""
    chunks = []
    async with asyncio.timeout(timeout_s):
        while chunk := await asyncio.get_running_loop().sock_recv(sock, 65536):
            chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


async def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    try:
        await _read_all(sock, timeout_s)
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True
