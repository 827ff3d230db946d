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
from tandem.gateway import connections
from tandem.gateway.connections import (
    SPARE_DESCRIPTORS,
    ConnectionGuard,
    address_of,
    check_descriptors,
    ensure_descriptors,
)
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
    still has the most, the new connection counted against its own: TWO's connections let in, each
    waiting after its answer, come to hold as many as ONE's, and then TWO's waiting longest is closed."""
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=5) as url:
        ones = [await connect(url, host=ONE) for _ in range(4)]
        twos = [await connect(url, host=TWO)]
        try:
            for _ in range(3):
                twos.append((await _let_in(url, TWO))[0])  # ONE 4:2 (closing ONE's), then 3:3, 3:3
            statuses = [await _health(sock) for sock in (*ones, *twos)]
        finally:
            for sock in (*ones, *twos):
                sock.close()
    assert statuses == [None, 200, 200, 200, None, None, 200, 200]


async def test_of_an_address_the_connection_waiting_longest_gives_its_place_up_not_the_one_open_longest() -> (
    None
):
    """A pooled keep-alive connection in steady use, opened first, was closed first (and a request it
    sent as it was closed, lost), ahead of connections idle for longer."""
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=4) as url:
        busy = await connect(url, host=ONE)
        idle = [await connect(url, host=ONE) for _ in range(3)]
        try:
            for sock in (*idle, busy):  # `busy`'s request last: it has waited least since
                assert await _health(sock) == 200
            other, _ = await _let_in(url, OTHER)
            other.close()
            statuses = [await _health(sock) for sock in (busy, *idle)]
        finally:
            for sock in (busy, *idle):
                sock.close()
    assert statuses == [200, None, 200, 200]


async def test_a_new_connection_counts_against_its_own_address_so_a_tie_closes_one_of_its_own() -> None:
    """ONE's two keep-alive connections and TWO's two silent sockets hold the 4 places: a third from
    TWO closed one of ONE's (2 waiting each, the first address to have one giving up), so that an
    address opening sockets took the places of another's pool one at a time."""
    async with fake_decoder() as (_, address), live_gateway(address, max_connections=4) as url:
        pool = [await connect(url, host=ONE) for _ in range(2)]
        silent = [await connect(url, host=TWO) for _ in range(2)]
        socks = [*pool, *silent]
        try:
            assert [await _health(sock) for sock in pool] == [200, 200]
            newcomer, _ = await _let_in(url, TWO)
            socks.append(newcomer)
            statuses = [await _health(sock) for sock in (*pool, *silent)]
        finally:
            for sock in socks:
                sock.close()
    assert statuses == [200, 200, None, 200]  # TWO's waiting longest


class _Transport(asyncio.WriteTransport):
    """A connection's transport as the guard sees it (its caller's address; what is written to it,
    whether it is closed), for a guard driven without a loop pass between its connections."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self.host, 5678) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


class _NotStarted(asyncio.Protocol):
    """aiohttp's handler between a connection's `connection_made` and its first run on the loop: no
    `_waiter` yet (aiohttp sets it once its task runs)."""

    _waiter = None


def _made(guard: ConnectionGuard, transport: asyncio.BaseTransport) -> asyncio.Protocol:
    protocol = guard()
    protocol.connection_made(transport)
    return protocol


async def test_connections_let_in_this_pass_of_the_loop_that_received_nothing_count_as_waiting() -> None:
    """A burst: connections accepted in one pass of the loop, their handlers not yet run, were not seen
    waiting, and a caller among them was answered 503 (8 of 20 bursts of 8 silent sockets and one
    GET /health at a bound of 8)."""
    guard = ConnectionGuard(_NotStarted, max_connections=2, header_timeout_s=10, write_timeout_s=10)
    silent = [_Transport(ONE), _Transport(ONE)]
    for transport in silent:
        _made(guard, transport)
    probe = _Transport(OTHER)
    _made(guard, probe)
    assert (probe.written, probe.closed) == (b"", False)
    assert [transport.closed for transport in silent] == [True, False]
    assert (guard.num_open, guard.num_evicted, guard.num_refused) == (2, 1, 0)


class _Busy(asyncio.Protocol):
    """aiohttp's handler handling a request (no `_waiter`), counting the guard's looks at it."""

    num_looks = 0

    @property
    def _waiter(self) -> None:
        _Busy.num_looks += 1
        return None


async def test_a_count_that_found_none_waiting_is_not_made_again_until_a_connection_may_wait() -> None:
    """Each refusal counted every connection: 0.138-0.170 ms of the gateway's CPU a refusal against
    0.060-0.088 before any place was given up, 512 connections held mid-request."""
    guard = ConnectionGuard(_Busy, max_connections=100, header_timeout_s=10, write_timeout_s=10)
    held = []
    for _ in range(100):
        held.append(_made(guard, _Transport(ONE)))
        held[-1].data_received(b"POST /v1/completions HTTP/1.1\r\n")  # a request under way
    _Busy.num_looks = 0
    refused = [_Transport(OTHER) for _ in range(1000)]
    for transport in refused:
        _made(guard, transport)
    assert all(transport.written.startswith(b"HTTP/1.1 503") for transport in refused)
    assert _Busy.num_looks == 100  # one count, for the first
    held[0].connection_lost(None)  # a place freed: the next is let in, and the one after counts again
    _made(guard, _Transport(OTHER)).data_received(b"POST /v1/completions HTTP/1.1\r\n")
    _made(guard, _Transport(OTHER))
    assert (guard.num_refused, _Busy.num_looks) == (1001, 200)


class _Idle(asyncio.Protocol):
    """aiohttp's handler waiting for a request head (its `_waiter` pending), whatever it receives."""

    def __init__(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()


async def test_a_waiting_connection_whose_next_request_arrived_unread_keeps_its_place() -> None:
    """A keep-alive caller's next request sent as a new connection came, its bytes arrived before the
    count but not yet read by the loop: closing it lost the request (30 of 100 in r4's race)."""
    guard = ConnectionGuard(_Idle, max_connections=1, header_timeout_s=10, write_timeout_s=10)
    server = await asyncio.get_running_loop().create_server(guard, "127.0.0.1", 0)
    caller = socket.create_connection(server.sockets[0].getsockname()[:2])
    try:
        async with asyncio.timeout(5):
            while guard.num_open < 1:
                await asyncio.sleep(0.01)
        caller.sendall(HEALTH)  # in the gateway's kernel buffer: the loop has not run since
        arrived_unread = _Transport(OTHER)
        _made(guard, arrived_unread)
        assert arrived_unread.written.startswith(b"HTTP/1.1 503")
        await asyncio.sleep(0.05)  # read now: its handler (_Idle) waits again, nothing unread
        let_in = _Transport(OTHER)
        _made(guard, let_in)
        assert (let_in.written, guard.num_evicted, guard.num_refused) == (b"", 1, 1)
    finally:
        caller.close()
        server.close()


async def test_connections_closed_or_refused_at_the_bound_are_a_warning_line_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Counted for tests alone, an operator saw nothing of a gateway closing its callers' keep-alive
    connections at the bound: the first is said at once, naming its address, the rest together."""
    monkeypatch.setattr(connections, "TELL_EVERY_S", 0.1)
    caplog.set_level(logging.WARNING, "tandem.gateway")
    guard = ConnectionGuard(_NotStarted, max_connections=1, header_timeout_s=10, write_timeout_s=10)
    _made(guard, _Transport(ONE))
    _made(guard, _Transport(OTHER))  # ONE's closed for it: said at once
    first = [record.getMessage() for record in caplog.records]
    third = _made(guard, _Transport(OTHER))  # OTHER's own closed for this one
    third.data_received(b"GET /health HTTP/1.1\r\n")  # under way: none waits
    for _ in range(2):
        _made(guard, _Transport(THIRD))  # refused
    assert [record.getMessage() for record in caplog.records] == first
    await asyncio.sleep(0.25)  # the line at the end of TELL_EVERY_S, then none: nothing since
    assert [record.getMessage() for record in caplog.records] == [
        "at --max-connections 1 since the last such line: 1 connections waiting for a request head "
        "closed for new ones (most of 127.0.0.9: 1)",
        "at --max-connections 1 since the last such line: 1 connections waiting for a request head "
        "closed for new ones (most of 127.0.0.10: 1); 2 new connections refused 503, none waiting "
        "(most from 127.0.0.11: 2)",
    ]
