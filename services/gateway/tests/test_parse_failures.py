"""A request aiohttp's parser refuses is named by its reason, never by the bytes it failed on: a
bearer token in an over-long or malformed header line reached the caller's 400 and the gateway's log."""

from __future__ import annotations

import asyncio
import logging
from unittest import mock

import pytest
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong, TransferEncodingError
from aiohttp.http_parser import HttpRequestParserC, HttpRequestParserPy

from tandem.gateway.parse_failures import NOT_HTTP, reason_of

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, send

SECRET = b"sekret"
GET = b"GET / HTTP/1.1\r\n"
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
REFUSED = {
    "a token past the line bound": GET + b"Authorization: Bearer " + SECRET * 2000 + b"\r\n\r\n",
    "a request line past it": b"GET /" + SECRET * 2000 + b" HTTP/1.1\r\n\r\n",
    "a control character in a token": GET + b"Authorization: Bearer sek\x01" + SECRET + b"\r\n\r\n",
    "a NUL in a token": GET + b"Authorization: Bearer \x00" + SECRET + b"\r\n\r\n",
    "a header without a colon": GET + b"Host x\r\nAuthorization " + SECRET + b"\r\n\r\n",
    "a method that is none": b"G\x01T /" + SECRET + b" HTTP/1.1\r\n\r\n",
    "a request line of four words": b"GET /" + SECRET + b" x HTTP/1.1\r\n\r\n",
    "a chunk size that is not hex": HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + SECRET + b"\r\nabc\r\n",
}


def _refusal(parser_class: type, sent: bytes) -> HttpProcessingError:
    parser = parser_class(
        mock.Mock(), asyncio.new_event_loop(), 2**16, max_line_size=8190, max_field_size=8190
    )
    with pytest.raises(HttpProcessingError) as refused:
        parser.feed_data(sent)
    return refused.value


@pytest.mark.parametrize("parser_class", [HttpRequestParserC, HttpRequestParserPy], ids=["C", "Python"])
@pytest.mark.parametrize("sent", REFUSED.values(), ids=REFUSED.keys())
def test_no_reason_quotes_the_bytes_the_parser_failed_on(parser_class: type, sent: bytes) -> None:
    reason = reason_of(_refusal(parser_class, sent))
    assert reason and not any(quoted in reason for quoted in ("sek", "b'", "\\x", "Host x", "G\x01T"))


def test_aiohttp_s_own_message_quotes_a_token_past_the_line_bound() -> None:
    """Why the reason is the gateway's: what aiohttp says of it."""
    error = _refusal(HttpRequestParserC, REFUSED["a token past the line bound"])
    assert "Bearer sekret" in error.message


@pytest.mark.parametrize("parser_class", [HttpRequestParserC, HttpRequestParserPy], ids=["C", "Python"])
def test_a_line_over_its_bound_is_named_by_the_bound(parser_class: type) -> None:
    reason = reason_of(_refusal(parser_class, REFUSED["a token past the line bound"]))
    assert reason.startswith("a line of the request is over 8190 bytes")


def test_llhttp_s_description_is_kept_without_its_bytes() -> None:
    reason = reason_of(_refusal(HttpRequestParserC, REFUSED["a control character in a token"]))
    assert reason == "Invalid header value char"


def test_the_aiohttp_layouts_the_reasons_rely_on_hold() -> None:
    """A canary on aiohttp's wording (pinned to 3.14 in pyproject): llhttp's layout, the request line's
    prefix, the HTTPS-on-HTTP wording and LineTooLong's limit. Laid out otherwise, a reason is only the
    kind of failure (fails closed), and these say what changed."""
    assert (
        reason_of(_refusal(HttpRequestParserC, REFUSED["a header without a colon"])) == "Invalid header token"
    )
    assert reason_of(_refusal(HttpRequestParserC, REFUSED["a request line of four words"])) == (
        "Expected HTTP/, RTSP/ or ICE/"
    )
    tls = _refusal(HttpRequestParserC, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    assert reason_of(tls) == "Received HTTPS traffic on an HTTP port"
    assert "8190 bytes" in reason_of(_refusal(HttpRequestParserPy, REFUSED["a request line past it"]))


@pytest.mark.parametrize(
    "error",
    [
        BadHttpMessage("Invalid header value char: sekret"),  # llhttp's description, its layout another
        BadHttpMessage("Invalid header value char:\n\n  sekret\n  ^"),  # the bytes not a repr
        TransferEncodingError("sekret"),
        LineTooLong(b"sekret", "8190 (sekret)"),  # a limit that is not a number
    ],
    ids=["another layout", "bytes not quoted", "pure-Python's quote", "a limit that is not a number"],
)
def test_a_message_in_an_unfamiliar_layout_is_named_by_its_kind_only(error: HttpProcessingError) -> None:
    reason = reason_of(error)
    assert "sekret" not in reason
    assert reason in (NOT_HTTP, "a chunked body's framing is not HTTP") or reason.startswith(
        "a line of the request is over its bound"
    )


def test_a_line_over_its_bound_is_not_said_to_be_a_head_line_only() -> None:
    """Chunk-size lines and trailers have the same bound, and a body's failure says it too."""
    reason = reason_of(LineTooLong(b"x", 8190))
    assert "chunk-size line" in reason and "trailer line" in reason


FIRST_CHUNK = b'5\r\n{"a":\r\n'
# Chunked bodies whose framing fails on SECRET after a first chunk (r1's body_leak_split.py): the
# handler is reading the body when it fails, and the 400 is the gateway's (`BodyIntake._read`).
BODY_REFUSED = {
    "a chunk size that is not hex": SECRET + b"\r\n",
    "a chunk-size line past the bound": SECRET + b"f" * 9000 + b"\r\n",
    "a control character in a chunk extension": b"5;ext=" + SECRET + b'\x01\r\n{"a":\r\n',
    "chunk data without its CRLF": b'3\r\n{"a' + SECRET + b"\r\n",
    "a trailer that is not a header": b"0\r\n" + SECRET + b"\x01: v\r\n\r\n",
    "a trailer past the bound": b"0\r\nX-T: " + SECRET + b"a" * 9000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("parser_class", [HttpRequestParserC, HttpRequestParserPy], ids=["C", "Python"])
@pytest.mark.parametrize("rest", BODY_REFUSED.values(), ids=BODY_REFUSED.keys())
async def test_a_body_whose_framing_fails_while_read_is_refused_without_its_bytes(
    parser_class: type, rest: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The 400 quoted aiohttp's message: the caller's bytes after the failing chunk-size or trailer."""
    monkeypatch.setattr("aiohttp.web_protocol.HttpRequestParser", parser_class)  # as AIOHTTP_NO_EXTENSIONS
    caplog.set_level(logging.DEBUG)
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        sock = await connect(url)
        await send(sock, COMPLETIONS_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + FIRST_CHUNK)
        await asyncio.sleep(0.2)  # the handler reads the first chunk and waits for more
        await send(sock, rest)
        try:
            status, answer = await read_answer(sock, 5)
        except TimeoutError:  # aiohttp's pure-Python parser takes a control character in an extension
            assert parser_class is HttpRequestParserPy and b"ext=" in rest
            status, answer = 400, {"error": {"message": ""}}
        finally:
            sock.close()
    assert status == 400
    assert b"sekret" not in answer["error"]["message"].encode()
    assert not [r for r in caplog.records if "sekret" in r.getMessage()]
