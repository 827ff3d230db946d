"""The gateway raises its open-files limit to what --max-connections needs, or refuses to start
naming the flag: a gateway out of descriptors would refuse every caller, not just the extra ones. A
request that is not HTTP as it must be is answered 400 in OpenAI's error shape, one log line without a
traceback, and the gateway serves on."""

from __future__ import annotations

import json
import logging
import resource
from collections.abc import AsyncIterator

import pytest

from tandem.client.errors import ConfigError
from tandem.gateway.connections import SPARE_DESCRIPTORS, check_descriptors, ensure_descriptors

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_to_close, send

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
