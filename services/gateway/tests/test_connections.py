"""The gateway raises its open-files limit to what --max-connections needs, or refuses to start
naming the flag: a gateway out of descriptors would refuse every caller, not just the extra ones. At
the bound, a new connection takes the place of one waiting for a request head, of the address holding
the most of them; a connection mid-request or mid-answer keeps its place, and where none waits the new
one is answered 503. A request that is not HTTP as it must be is answered 400 in OpenAI's error shape,
one log line without a traceback, and the gateway serves on."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from collections.abc import AsyncIterator

import pytest

from tandem.client.errors import ConfigError
from tandem.gateway.connections import SPARE_DESCRIPTORS, address_of, check_descriptors, ensure_descriptors
from tandem.gateway.parse_failures import NOT_HTTP

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, read_to_close, send

CHUNKED = COMPLETIONS_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


@pytest.fixture
def limits():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


@pytest.fixture
def soft_below_need(limits: tuple[int, int]) -> int:
    """The soft limit set below what 300 connections and 10 idle channels need; returns that need."""
    soft, hard = limits
    need = 2 * 300 + 10 + SPARE_DESCRIPTORS
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this process's hard limit ({hard}) is below {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, need - 1), hard))
    return need


def test_the_soft_limit_is_raised_to_what_the_connections_need(soft_below_need: int) -> None:
    assert ensure_descriptors(300, 10) == soft_below_need
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft_below_need


def test_a_hard_limit_too_low_is_a_config_error_naming_max_connections(limits: tuple[int, int]) -> None:
    soft, hard = limits
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(ConfigError) as error:
        ensure_descriptors(hard, 0)  # two descriptors a connection: twice the limit
    assert error.value.field == "max_connections" and str(hard) in str(error.value)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == limits  # nothing changed


def test_the_check_alone_says_what_the_connections_need_and_changes_no_limit(soft_below_need: int) -> None:
    """`tandem up` runs it before starting the gateway, which inherits up's limits."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert check_descriptors(300, 10) == soft_below_need
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == before


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        yield url


async def _sent_back(url: str, sent: bytes) -> tuple[bytes, dict]:
    """The head and the JSON body the gateway answers `sent` with, on a connection of its own."""
    sock = await connect(url)
    try:
        await send(sock, sent)
        head, _, body = (await read_to_close(sock, 5)).partition(b"\r\n\r\n")
    finally:
        sock.close()
    return head, json.loads(body)


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"GET /v1/models HTTP/9.9\r\n\r\n", id="an HTTP version that is none"),
        pytest.param(b"GET /v1/mo dels HTTP/1.1\r\n\r\n", id="a request line of four words"),
        pytest.param(b"GET /v1/models HTTP/1.1\r\nHost x\r\n\r\n", id="a header without a colon"),
        pytest.param(CHUNKED + b"zz\r\nabc\r\n", id="a chunk size that is not hex"),
        pytest.param(
            COMPLETIONS_HEAD + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", id="both lengths"
        ),
        pytest.param(COMPLETIONS_HEAD + b"Content-Length: -5\r\n\r\n", id="a negative length"),
    ],
)
async def test_a_request_that_is_not_http_is_an_openai_400_and_one_log_line_without_a_traceback(
    url: str, sent: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        head, answer = await _sent_back(url, sent)
    assert head.split()[1] == b"400" and b"content-type: application/json" in head.lower()
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] is None
    assert answer["error"]["message"].startswith("the request is not HTTP as it must be: ")
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [(r.levelno, r.exc_info) for r in logged] == [(logging.INFO, None)]
    assert logged[0].getMessage().startswith("Error handling request from 127.0.0.1: ")
    head, answer = await _sent_back(url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert head.split()[1] == b"200" and answer["data"][0]["id"] == "fake-model"  # the gateway serves on


async def test_a_body_labelled_gzip_is_not_decoded_after_a_401_nor_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Plain JSON labelled gzip, from a caller with no token: answered 401 unread, then aiohttp's drain
    # failed decoding it and logged "Unhandled exception" with three chained tracebacks.
    body = b'{"prompt": "hi"}'
    head = COMPLETIONS_HEAD + b"Connection: close\r\nContent-Encoding: gzip\r\n"
    sent = head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    async with (
        fake_decoder() as (_, address),
        live_gateway(address, auth_tokens=frozenset({"sekret"})) as url,
    ):
        with caplog.at_level(logging.INFO, logger="aiohttp.server"):
            head, answer = await _sent_back(url, sent)  # read to the close: the drain has run
    assert head.split()[1] == b"401" and answer["error"]["type"] == "authentication_error"
    assert [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"] == []


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b"Authorization: Bearer " + b"sekret" * 200_000, id="a token past the line bound"),
        pytest.param(b"Authorization: Bearer sek\x01ret", id="a control character in a token"),
    ],
)
async def test_a_refused_header_line_is_quoted_neither_to_the_caller_nor_in_the_log(
    url: str, header: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp's message quoted the line's first 100 bytes, a bearer token, into the 400 and the log.
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        head, answer = await _sent_back(url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
    assert head.split()[1] == b"400"
    logged = [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"]
    for said in (answer["error"]["message"], *logged):
        assert "sek" not in said and "Bearer" not in said
    if b"\x01" not in header:
        assert "over 8190 bytes" in answer["error"]["message"] and "over 8190 bytes" in logged[0]


async def test_a_head_that_arrived_ends_the_header_timer_and_a_stalled_body_is_answered_408() -> None:
    """The connection guard is set on the Gateway after its app is built (__main__, live_gateway) and
    reaches the middlewares that stop a connection's header timer once a head is in: a body stalled past
    --body-idle-timeout-s is then answered 408, never cut at --header-timeout-s with no answer (with the
    guard left unwired: a silent close at 0.31 s)."""
    async with (
        fake_decoder() as (_, address),
        live_gateway(address, header_timeout_s=0.3, body_timeout_s=1.5, body_idle_timeout_s=1.5) as url,
    ):
        sock = await connect(url)
        try:
            await send(sock, COMPLETIONS_HEAD + b"Content-Length: 1000\r\n\r\n{")
            head, _, body = (await read_to_close(sock, 10)).partition(b"\r\n\r\n")
        finally:
            sock.close()
    assert head.split()[1] == b"408", head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


async def test_a_failure_of_no_named_kind_says_the_request_is_not_http_once(url: str) -> None:
    # 5,000 header lines: "the request is not HTTP as it must be: the request is not HTTP as it must be".
    lines = b"".join(b"X-%d: y\r\n" % i for i in range(5000))
    head, answer = await _sent_back(url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert head.split()[1] == b"400" and answer["error"]["message"] == NOT_HTTP


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
ONE, TWO, OTHER, THIRD = "127.0.0.9", "127.0.0.12", "127.0.0.10", "127.0.0.11"  # callers' addresses


async def _health(sock: socket.socket, sent: bytes = HEALTH) -> int | None:
    """The status `sent` (the rest of a GET /health head) is answered with on `sock`; None where the
    gateway had closed the connection."""
    try:
        await send(sock, sent)
        return (await read_answer(sock, 5))[0]
    except ConnectionError:
        return None


async def _let_in(url: str, host: str) -> tuple[socket.socket, list[int | None]]:
    """A connection from `host` whose GET /health is answered 200, and the statuses of those tried
    before it (503s while the gateway had not yet seen the held connections wait: it shares this
    loop), tried for at most 5 s, well within --header-timeout-s."""
    statuses: list[int | None] = []
    async with asyncio.timeout(5):
        while True:
            sock = await connect(url, host=host)
            statuses.append(await _health(sock))
            if statuses[-1] == 200:
                return sock, statuses[:-1]
            sock.close()
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("sent", "rest"),
    [
        pytest.param(b"", HEALTH, id="nothing"),
        pytest.param(HEALTH[:20], HEALTH[20:], id="part of a head"),
    ],
)
async def test_at_the_bound_a_new_caller_takes_the_place_of_a_connection_that_sent_no_request_head(
    sent: bytes, rest: bytes
) -> None:
    """One address's connections that send no head (or a part of one) held every place: a caller from
    another address was answered 503 until the header timeout closed them (and they came back)."""
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=4) as url:
        held = [await connect(url, host=ONE) for _ in range(4)]
        try:
            for sock in held:
                await send(sock, sent)
            other, _ = await _let_in(url, OTHER)
            other.close()
            statuses = [await _health(sock, rest) for sock in held]
        finally:
            for sock in held:
                sock.close()
    assert statuses == [None, 200, 200, 200]  # the one open longest closed, the others served


async def test_a_keep_alive_connection_waiting_for_its_next_head_gives_its_place_up_too() -> None:
    """One GET /health on each, then nothing: a keep-alive connection idle until --idle-timeout-s."""
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=4) as url:
        held = [await connect(url, host=ONE) for _ in range(4)]
        try:
            assert [await _health(sock) for sock in held] == [200] * 4
            other, _ = await _let_in(url, OTHER)
            other.close()
            statuses = [await _health(sock) for sock in held]
        finally:
            for sock in held:
                sock.close()
    assert statuses == [None, 200, 200, 200]


async def test_the_address_holding_the_most_waiting_connections_gives_one_up_first() -> None:
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=3) as url:
        held = [await connect(url, host=host) for host in (TWO, ONE, ONE)]  # TWO's is open longest
        try:
            other, _ = await _let_in(url, OTHER)
            other.close()
            statuses = [await _health(sock) for sock in held]
        finally:
            for sock in held:
                sock.close()
    assert statuses == [200, None, 200]  # ONE's first, not TWO's


def _completion_head(body: bytes) -> bytes:
    return COMPLETIONS_HEAD + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)


async def _mid_request(sock: socket.socket, body: bytes) -> None:
    """`sock` mid-request: the gateway has read its request head (it asked for the body with `100
    Continue`), and the body is not sent."""
    await send(sock, _completion_head(body))
    interim, sent = b"HTTP/1.1 100 Continue\r\n\r\n", b""
    async with asyncio.timeout(5):
        while len(sent) < len(interim):
            sent += await asyncio.get_running_loop().sock_recv(sock, len(interim) - len(sent))
    assert sent == interim, sent


async def _mid_answer(url: str, host: str) -> socket.socket:
    """A connection from `host` whose streamed answer has begun and goes on (the fake's `hang`)."""
    sock = await connect(url, host=host)
    body = json.dumps({"prompt": "hang", "stream": True}).encode()
    await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    sent = b""
    async with asyncio.timeout(5):
        while b"data: " not in sent:
            sent += await asyncio.get_running_loop().sock_recv(sock, 65536)
    assert sent.startswith(b"HTTP/1.1 200"), sent[:200]
    return sock


async def _streams_on(sock: socket.socket) -> bool:
    """Whether more of the stream on `sock` comes."""
    loop, sent = asyncio.get_running_loop(), b""
    async with asyncio.timeout(5):
        while b"data: " not in sent:
            if not (chunk := await loop.sock_recv(sock, 65536)):
                return False
            sent += chunk
    return True


async def test_a_connection_mid_request_or_mid_answer_keeps_its_place_and_with_none_waiting_503() -> None:
    body = json.dumps({"prompt": "q", "max_tokens": 2}).encode()
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=3) as url:
        streaming = await _mid_answer(url, ONE)  # open longest, then mid-request, then waiting
        reading = await connect(url, host=ONE)
        waiting = await connect(url, host=ONE)
        socks = [streaming, reading, waiting]
        try:
            await _mid_request(reading, body)
            other, _ = await _let_in(url, OTHER)  # `waiting` closed for it
            socks.append(other)
            await _mid_request(other, body)  # now every place is mid-request or mid-answer
            third = await connect(url, host=THIRD)
            socks.append(third)
            refused = await read_to_close(third, 5)
            assert await _streams_on(streaming)
            answers = []
            for sock in (reading, other):
                await send(sock, body)
                answers.append(await read_answer(sock, 5))
            waiting_status = await _health(waiting)
        finally:
            for sock in socks:
                sock.close()
    assert refused.startswith(b"HTTP/1.1 503") and b"--max-connections" in refused
    assert [(status, answer["choices"][0]["text"][:3]) for status, answer in answers] == [(200, "<q>")] * 2
    assert waiting_status is None


@pytest.mark.parametrize(
    ("peername", "share"),
    [
        pytest.param(("10.0.0.1", 5678), "10.0.0.1", id="IPv4"),
        pytest.param(("2001:db8::1:2:3:4", 5678, 0, 0), "2001:db8::/64", id="IPv6: its /64"),
        pytest.param(("2001:db8::ffff:1", 1, 0, 0), "2001:db8::/64", id="IPv6: the same /64"),
        pytest.param(("::ffff:10.0.0.1", 5678, 0, 0), "10.0.0.1", id="IPv4-mapped: its IPv4 address"),
        pytest.param(("fe80::1%eth0", 5678, 0, 2), "fe80::/64", id="IPv6 with a zone"),
    ],
)
def test_a_connection_s_share_is_its_address_read_as_the_health_watch_share_reads_it(
    peername: tuple, share: str
) -> None:
    assert address_of(peername) == share


async def test_a_connection_that_began_a_request_since_the_last_count_keeps_its_place() -> None:
    """The waiting connections counted for one new connection are kept for the next ones (the lead
    their address has: `ConnectionGuard._evict_one`), and each is looked at again before it is closed."""
    body = json.dumps({"prompt": "q", "max_tokens": 2}).encode()
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=5) as url:
        held = [await connect(url, host=ONE) for _ in range(5)]
        socks = list(held)
        try:
            other, _ = await _let_in(url, OTHER)  # held[0] closed; held[1:] kept, waiting, for the next
            socks.append(other)
            await _mid_request(held[1], body)  # no longer waiting
            third, _ = await _let_in(url, THIRD)
            socks.append(third)
            await send(held[1], body)
            answer = await read_answer(held[1], 5)
            statuses = [await _health(sock) for sock in (held[0], held[2], held[3], held[4])]
        finally:
            for sock in socks:
                sock.close()
    assert answer[0] == 200 and answer[1]["choices"][0]["text"].startswith("<q>")
    assert statuses == [None, None, 200, 200]  # held[2] closed for the third, not held[1]


async def test_an_address_that_comes_to_hold_the_most_waiting_connections_gives_them_up_from_then() -> None:
    """The waiting connections counted once serve the next connections only while their address
    still has the most: TWO's connections let in, each waiting after its answer, come to outnumber
    ONE's, and then TWO's open longest is closed."""
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=5) as url:
        ones = [await connect(url, host=ONE) for _ in range(4)]
        twos = [await connect(url, host=TWO)]
        try:
            for _ in range(3):
                twos.append((await _let_in(url, TWO))[0])  # ONE 4:1, then 3:2 (each closing ONE's), 2:3
            statuses = [await _health(sock) for sock in (*ones, *twos)]
        finally:
            for sock in (*ones, *twos):
                sock.close()
    assert statuses == [None, None, 200, 200, None, 200, 200, 200]
