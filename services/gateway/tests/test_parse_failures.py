"""A request aiohttp's parser refuses is named by its reason, never by the bytes it failed on: a
bearer token in an over-long or malformed header line reached the caller's 400 and the gateway's log."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParserC, HttpRequestParserPy

from tandem.gateway.parse_failures import reason_of

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
