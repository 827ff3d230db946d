"""Which refusals close their connection: a 413 for a body over --max-body-bytes whose rest is still
coming does, answered at once with `Connection: close` without waiting for the rest (however it is
sent: a Content-Length over the bound, or chunks past it; aiohttp drops what more comes for its
lingering time, then closes); a 413 once the whole body was read (an answer over
--max-unread-answer-bytes, or a body over the bound that aiohttp had already read whole) keeps it, and
the caller's next request is served on it, as a client's connection pool sends it. A head asking
`Expect: 100-continue` is refused before its body is asked for where the body would be refused unread. A
401 leaves what more comes of the body unparsed and closes its connection: a caller with no token costs
no parsing of its body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from aiohttp import StreamReader

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, UNREAD_BODY, connect, read_to_close, send

SMALL_BODY = json.dumps({"prompt": "q", "n": 2}).encode()


def _request(body: bytes) -> bytes:
    return COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


async def _answer(sock: socket.socket) -> tuple[int, bytes, dict]:
    """The next answer's status, head (lower case) and JSON; ConnectionError when the connection ends
    first (a closed socket reads b"" at once, without yielding to a timeout)."""
    loop, sent = asyncio.get_running_loop(), b""
    async with asyncio.timeout(5):
        while b"\r\n\r\n" not in sent:
            if not (chunk := await loop.sock_recv(sock, 65536)):
                raise ConnectionError(f"closed after {sent[:200]!r}")
            sent += chunk
        head, _, body = sent.partition(b"\r\n\r\n")
        head = head.lower()
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if b"content-length:" in line)
        while len(body) < length:
            if not (chunk := await loop.sock_recv(sock, 65536)):
                raise ConnectionError(f"closed after {sent[:200]!r}")
            body += chunk
    return int(head.split()[1]), head, json.loads(body)


async def test_an_answer_over_the_gateways_bound_is_413_on_a_connection_kept_for_the_next_request() -> None:
    bounds = {"max_unread_answer_bytes": 300_000, "max_unread_answer_bytes_per_caller": 100_000}
    async with fake_decoder() as (_, address), live_gateway(address, **bounds) as url:
        sock = await connect(url)
        try:
            await send(sock, _request(UNREAD_BODY))  # its answer reserves 413,668 bytes
            status, head, refused = await _answer(sock)
            assert status == 413 and "--max-unread-answer-bytes" in refused["error"]["message"]
            assert b"connection: close" not in head
            await send(sock, _request(SMALL_BODY))
            status, _, answer = await _answer(sock)  # was: closed after the 413
            assert status == 200 and len(answer["choices"]) == 2
        finally:
            sock.close()


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(COMPLETIONS_HEAD + b"Content-Length: 100000\r\n\r\n", id="declared over the bound"),
        pytest.param(COMPLETIONS_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", id="chunks past the bound"),
    ],
)
async def test_a_body_over_the_bound_is_413_at_once_and_closes_its_connection(head: bytes) -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address, max_body_bytes=4096) as url:
        sock = await connect(url)
        try:
            sent = b'{"prompt": "' + b"x" * 8192
            chunked = b"Transfer-Encoding: chunked" in head
            await send(sock, head + (b"%x\r\n%s\r\n" % (len(sent), sent) if chunked else sent))
            status, head, refused = await _answer(sock)  # the rest never sent
            assert (status, refused["error"]["param"]) == (413, "body") and b"connection: close" in head
            assert not decoder.requests
        finally:
            sock.close()


async def _interim_or_answer(sock: socket.socket) -> bytes:
    """What the gateway sends first after a head: `100 Continue`, or an answer whole (to its length)."""
    loop, sent = asyncio.get_running_loop(), b""
    async with asyncio.timeout(5):
        while not sent.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
            head, gap, body = sent.partition(b"\r\n\r\n")
            lengths = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
            if gap and lengths and len(body) >= int(lengths[0].split(b":")[1]):
                return sent
            if not (chunk := await loop.sock_recv(sock, 65536)):
                return sent
            sent += chunk
    return sent


EXPECT = COMPLETIONS_HEAD + b"Expect: 100-continue\r\n"


@pytest.mark.parametrize(
    ("token", "status", "named"),
    [
        pytest.param(b"a", 413, "over 4096 bytes (--max-body-bytes)", id="over the bound"),
        pytest.param(b"unknown", 401, "bearer token", id="no accepted token: the bound not told"),
    ],
)
async def test_an_expected_body_over_the_bound_is_refused_before_it_is_sent(
    token: bytes, status: int, named: str
) -> None:
    """`Expect: 100-continue` with a length over --max-body-bytes: refused at once, the body never asked
    for (was `100 Continue`, then the 413 once 5,000 bytes were sent), in the normal path's order (the
    token first), and the connection closed with the answer."""
    settings = {"max_body_bytes": 4096, "auth_tokens": frozenset({"a"})}
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            await send(sock, EXPECT + b"Authorization: Bearer %s\r\nContent-Length: 5000\r\n\r\n" % token)
            sent = await _interim_or_answer(sock)
            head, _, body = sent.partition(b"\r\n\r\n")
            assert int(head.split()[1]) == status and b"connection: close" in head.lower()
            assert named in json.loads(body)["error"]["message"] and not decoder.requests
        finally:
            sock.close()


@pytest.mark.parametrize(
    "repeated", [b"", b"Expect: 100-continue\r\n", b"Expect: 100-Continue, 100-continue\r\n"]
)
async def test_an_expected_body_within_the_bound_is_asked_for_and_served(repeated: bytes) -> None:
    # 100-continue said twice (two lines, or a list) was read as one unknown expectation: 417, closed.
    async with fake_decoder() as (_, address), live_gateway(address, max_body_bytes=4096) as url:
        sock = await connect(url)
        try:
            await send(sock, EXPECT + repeated + b"Content-Length: %d\r\n\r\n" % len(SMALL_BODY))
            assert await _interim_or_answer(sock) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await send(sock, SMALL_BODY)
            status, head, answer = await _answer(sock)
            assert status == 200 and len(answer["choices"]) == 2 and b"connection: close" not in head
        finally:
            sock.close()


@pytest.mark.parametrize(
    ("token", "status", "named"),
    [
        pytest.param(b"a", 413, "(--max-body-bytes)", id="over the bound"),
        pytest.param(b"unknown", 401, "bearer token", id="no accepted token"),
    ],
)
async def test_a_refused_expectation_is_read_by_a_client_that_sends_its_body_without_waiting(
    token: bytes, status: int, named: str
) -> None:
    """RFC 9110 lets a client send the body without waiting for `100 Continue` (Python's http.client
    does): the refusal is answered, the body read and dropped, and the connection closed after, not
    under the arriving body, which resets it with the answer unread (5 of 5 such 5 MB uploads)."""
    settings = {"max_body_bytes": 4096, "auth_tokens": frozenset({"a"})}
    body = b"x" * 5_000_000
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            head = EXPECT + b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (token, len(body))
            sending = asyncio.ensure_future(send(sock, head + body))
            sent = await _interim_or_answer(sock)
            await sending
            head_sent, _, answer = sent.partition(b"\r\n\r\n")
            assert int(head_sent.split()[1]) == status and b"connection: close" in head_sent.lower()
            assert named in json.loads(answer)["error"]["message"] and not decoder.requests
        finally:
            sock.close()


async def test_a_401_parses_no_more_of_the_body_and_closes_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # aiohttp drained the body after the 401, parsing all 8 MiB over a 4,096-byte bound, and kept the
    # connection for the caller's next body.
    parsed = [0]
    feed_data = StreamReader.feed_data

    def counted(reader: StreamReader, data: bytes, *args: object) -> None:
        parsed[0] += len(data)
        feed_data(reader, data, *args)

    monkeypatch.setattr(StreamReader, "feed_data", counted)
    settings = {"max_body_bytes": 4096, "auth_tokens": frozenset({"a"}), "lingering_s": 0.2}
    body = b"x" * 8 * 2**20
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            sending = asyncio.ensure_future(send(sock, _request(body)))
            sent = await read_to_close(sock, 2)
            with contextlib.suppress(ConnectionError):
                await sending  # the gateway closed under what it did not take
        finally:
            sock.close()
    head, _, answer = sent.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 401 and b"connection: close" in head.lower()
    assert json.loads(answer)["error"]["type"] == "authentication_error"
    assert parsed[0] <= 2**20  # what came with the head, of 8 MiB
    assert not decoder.requests


async def test_a_401_to_a_body_that_came_whole_keeps_its_connection() -> None:
    settings = {"auth_tokens": frozenset({"a"})}
    async with fake_decoder() as (_, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            for _ in range(2):
                await send(sock, _request(SMALL_BODY))
                status, head, _ = await _answer(sock)
                assert status == 401 and b"connection: close" not in head
        finally:
            sock.close()


TOKEN = b"Authorization: Bearer a\r\n"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", 401, id="GET, no token"),
        pytest.param(b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\n", 401, id="unknown path, no token"),
        pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\n", 200, id="health"),
        pytest.param(b"POST /v1/models HTTP/1.1\r\nHost: x\r\n" + TOKEN, 405, id="405"),
        pytest.param(b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\n" + TOKEN, 404, id="404"),
        # An empty path reached no route, aiohttp's expect handler instead: `100 Continue`, then the 401.
        pytest.param(b"GET http://x HTTP/1.1\r\nHost: x\r\n", 401, id="no path, no token"),
        pytest.param(b"POST http://x HTTP/1.1\r\nHost: x\r\n" + TOKEN, 404, id="no path"),
        pytest.param(b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n", 401, id="CONNECT, no token"),
        pytest.param(b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n" + TOKEN, 405, id="CONNECT"),
    ],
)
async def test_an_expected_body_a_route_does_not_read_is_never_asked_for(head: bytes, status: int) -> None:
    """`Expect: 100-continue` where no body is read (a 401 first): answered without `100 Continue`, the
    connection closed with the answer. aiohttp's own expect handler sent `100 Continue` first, inviting
    the 50 MB the head declared, the 401 after."""
    settings = {"max_body_bytes": 4096, "auth_tokens": frozenset({"a"})}
    async with fake_decoder() as (_, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            await send(sock, head + b"Expect: 100-continue\r\nContent-Length: 50000000\r\n\r\n")
            status_sent, head_sent, _ = await _answer(sock)
        finally:
            sock.close()
    assert status_sent == status and b"connection: close" in head_sent


NEXT = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def _answers_until_closed(sent: bytes, url: str) -> list[int]:
    """The statuses answered to `sent` before the gateway closed the connection."""
    sock = await connect(url)
    statuses: list[int] = []
    try:
        sending = asyncio.ensure_future(send(sock, sent))
        try:
            while True:
                statuses.append((await _answer(sock))[0])
        except ConnectionError:
            pass
        with contextlib.suppress(ConnectionError):
            await sending  # the gateway closed under what it did not take
    finally:
        sock.close()
    return statuses


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\n", id="health"),
        pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + TOKEN, id="models"),
        pytest.param(b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\n" + TOKEN, id="404"),
        pytest.param(b"POST /health HTTP/1.1\r\nHost: x\r\n", id="405"),
    ],
)
async def test_a_body_past_the_bound_that_an_answer_leaves_unread_is_dropped_and_its_connection_closed(
    head: bytes,
) -> None:
    # 8 MiB over a 4,096-byte bound: aiohttp drained all of it after the answer and served the next
    # request on the connection.
    settings = {"max_body_bytes": 4096, "auth_tokens": frozenset({"a"}), "lingering_s": 0.2}
    body = b"x" * 8 * 2**20
    async with fake_decoder() as (_, address), live_gateway(address, **settings) as url:
        answered = await _answers_until_closed(
            head + b"Content-Length: %d\r\n\r\n" % len(body) + body + NEXT, url
        )
    assert len(answered) == 1, answered


async def test_a_body_within_the_bound_an_answer_leaves_unread_is_drained_on_a_connection_kept() -> None:
    async with fake_decoder() as (_, address), live_gateway(address, max_body_bytes=4096) as url:
        sock = await connect(url)
        try:
            await send(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" + NEXT)
            answers = [await _answer(sock), await _answer(sock)]
        finally:
            sock.close()
    assert [(status, b"connection: close" in head) for status, head, _ in answers] == [(200, False)] * 2


NEXT_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + TOKEN + b"\r\n"  # a token's, sent as a body


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"GET http://x HTTP/1.1\r\nHost: x\r\n", id="no path"),
        pytest.param(b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n", id="CONNECT"),
        pytest.param(b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\n", id="a path"),
    ],
)
async def test_an_expectation_from_a_caller_with_no_token_is_told_401_and_nothing_after_its_head_is_read(
    head: bytes,
) -> None:
    # An empty path met aiohttp's expect handler: 417, and the request sent as the body answered 200.
    settings = {"auth_tokens": frozenset({"a"}), "lingering_s": 0.2}
    async with fake_decoder() as (_, address), live_gateway(address, **settings) as url:
        answered = await _answers_until_closed(head + b"Expect: foo\r\n\r\n" + NEXT_MODELS, url)
    assert answered == [401]


@pytest.mark.parametrize(
    "expect", [b"Expect: 100-continue\r\nExpect: foo\r\n", b"Expect: 100-continue, foo\r\n"]
)
async def test_every_expectation_of_every_expect_line_is_met_or_417(expect: bytes) -> None:
    # Only the first line was read: `100 Continue`, then the body served.
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        sock = await connect(url)
        try:
            await send(sock, COMPLETIONS_HEAD + expect + b"Content-Length: %d\r\n\r\n" % len(SMALL_BODY))
            head, _, _ = (await _interim_or_answer(sock)).partition(b"\r\n\r\n")
        finally:
            sock.close()
    assert int(head.split()[1]) == 417 and b"connection: close" in head.lower()
    assert not decoder.requests


async def test_a_connect_is_405_and_nothing_after_its_head_is_read() -> None:
    # This server is no proxy, and what follows a CONNECT's head is a tunnel's: it was answered 404, then
    # the bytes after it as a request.
    settings = {"auth_tokens": frozenset({"a"}), "lingering_s": 0.2}
    async with fake_decoder() as (_, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            await send(sock, b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n" + TOKEN + b"\r\n" + NEXT_MODELS)
            sent = await read_to_close(sock, 2)
        finally:
            sock.close()
    head, _, answer = sent.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 405 and b"allow: get, head, post" in head.lower()
    assert (
        json.loads(answer)["error"]["message"] == "CONNECT asks a proxy for a tunnel: this server is not one"
    )
    assert b"connection: close" in head.lower()
