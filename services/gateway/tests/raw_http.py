"""HTTP spoken by hand over a raw socket, for the tests of what a client library will not send: heads
alone, bodies that stall or trickle, bytes that are not HTTP, a caller that never reads.

A raw socket, not a StreamReader: what the gateway sent stays readable after it resets the connection
(a socket closed with a caller's bytes unread sends a reset), where a StreamReader would raise instead.
"""

from __future__ import annotations

import asyncio
import json
import socket

COMPLETIONS_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def port_of(url: str) -> int:
    """The port of a gateway's base URL (http://127.0.0.1:PORT/v1)."""
    return int(url.rsplit(":", 1)[1].split("/")[0])


async def connect(
    url: str, receive_buffer_bytes: int | None = None, host: str = "127.0.0.1"
) -> socket.socket:
    """A connection to the gateway at `url` from `host` (another loopback address: another caller);
    with `receive_buffer_bytes`, a receive buffer that small (set before connecting: the window the
    socket offers), so an answer it does not read backs up at once."""
    sock = socket.socket()
    sock.bind((host, 0))
    if receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port_of(url)))
    return sock


async def send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


async def read_to_close(sock: socket.socket, within_s: float) -> bytes:
    """What the gateway sends until it closes the connection (or resets it)."""
    sent = b""
    async with asyncio.timeout(within_s):
        try:
            while chunk := await asyncio.get_running_loop().sock_recv(sock, 65536):
                sent += chunk
        except ConnectionResetError:
            pass
    return sent


async def read_answer(sock: socket.socket, within_s: float) -> tuple[int, dict]:
    """The status and JSON of the gateway's answer, read to its Content-Length (the gateway may go on
    reading the rest of a refused body before it closes)."""
    loop, sent = asyncio.get_running_loop(), b""

    async def more() -> bytes:
        # A closed socket answers b"" at once, without yielding: looping on it spun past the timeout.
        if not (chunk := await loop.sock_recv(sock, 65536)):
            raise ConnectionError("the gateway closed the connection before its whole answer was read")
        return chunk

    async with asyncio.timeout(within_s):
        while b"\r\n\r\n" not in sent:
            sent += await more()
        head, _, body = sent.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:"))
        while len(body) < length:
            body += await more()
    return int(head.split()[1]), json.loads(body)


def parse_answer(sent: bytes) -> tuple[int, dict]:
    """The status and JSON of a whole answer as it was sent."""
    head, _, body = sent.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


UNREAD_BODY = json.dumps({"prompt": "p", "n": 8, "max_tokens": 50, "logprobs": 20}).encode()  # ~200 KiB


async def unread_answer(url: str, host: str = "127.0.0.1") -> socket.socket:
    """A connection (from `host`) whose answer of 8 choices (~200 KiB) is being written and read no
    further than its status, left in the socket for `read_answer`: a window of a few KiB."""
    sock = await connect(url, receive_buffer_bytes=4096, host=host)
    await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(UNREAD_BODY), UNREAD_BODY))
    async with asyncio.timeout(5):
        while (status := _peek(sock, 12)) != b"HTTP/1.1 200":
            assert b"HTTP/1.1 200".startswith(status), status
            await asyncio.sleep(0.01)
    return sock


def _peek(sock: socket.socket, size: int) -> bytes:
    try:
        return sock.recv(size, socket.MSG_PEEK)
    except BlockingIOError:
        return b""
