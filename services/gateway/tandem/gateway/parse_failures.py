"""What the gateway says of a request aiohttp's parser refused: its reason, never the caller's bytes.

NOTE: why aiohttp's own message is not said. Its parser quotes what it failed on: a header line over
8,190 bytes its first 100 (`Authorization: Bearer xxxx...`), a header value with a control character
the whole line, llhttp's failures the bytes around the failing one. That went into the caller's 400 and
into the gateway's log at INFO, a bearer token with it, where tokens never show in logs (SECURITY.md).
So the reason is named without them: llhttp's description (the text before its quoted bytes), the
bound a line went over, or the kind of failure where aiohttp's message is the caller's bytes.

NOTE: it fails closed. llhttp's description is kept only where the message has the exact layout
aiohttp 3.14 gives it (its description, a colon, a blank line, the bytes' repr, a caret: `_LLHTTP`),
and aiohttp's pure-Python messages are never kept (most quote the bytes): any other message, from an
aiohttp that words or lays them out otherwise, is named by its kind (`_KINDS`), a fixed text. The
layouts relied on are checked by test_parse_failures' canary: an aiohttp that changes them fails a
test, and its reasons lose llhttp's description, never hide a token.
"""

from __future__ import annotations

import re

from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestPayloadError

# llhttp's failures (aiohttp's C parser): its description, then the bytes around the failing one as a
# bytes repr (escaped: no line break of the caller's) and a caret under it. The description is
# llhttp's own text (`llhttp_get_error_reason`), words and a little punctuation.
_LLHTTP = re.compile(r"(?P<reason>[A-Za-z][\w ,.'()/-]{0,99}):\n\n  b(['\"])[^\n]*\2\n +\^")
_STATUS_LINE_PREFIX = "Bad status line:\n  "  # before the request line's llhttp failures
# aiohttp's HTTPS-on-an-HTTP-port message: the one that quotes nothing.
_TLS_ON_HTTP = "Received HTTPS traffic on an HTTP port"
# The kind of each failure, first match wins: what is said where aiohttp's message is not kept.
_KINDS: tuple[tuple[type[HttpProcessingError], str], ...] = (
    (BadHttpMethod, "the request line's method is not HTTP"),
    (BadStatusLine, "the request line is not HTTP"),
    (InvalidHeader, "a header or trailer is not HTTP (its name, or a character its value may not hold)"),
    (InvalidURLError, "the request target is not a URL"),
    (TransferEncodingError, "a chunked body's framing is not HTTP"),
    (ContentLengthError, "the body is not as long as its Content-Length says"),
    (ContentEncodingError, "the body could not be decoded as its Content-Encoding says"),
)
NOT_HTTP = "the request is not HTTP as it must be"  # any other failure
# A body's failure that carries no parser failure (a coding the gateway decodes itself: body_codings).
BODY_NOT_READ = "the body's bytes are not what its framing or its Content-Encoding says"
MAX_REASON_CHARS = 200


def reason_of(error: HttpProcessingError) -> str:
    """`error`'s reason, with none of the bytes the caller sent (see the NOTE: it fails closed)."""
    if isinstance(error, LineTooLong):
        # Its limit is `args[1]` (aiohttp 3.14); anything else is not said.
        limit = error.args[1] if len(error.args) > 1 else None
        bound = f"{limit} bytes" if isinstance(limit, int) and not isinstance(limit, bool) else "its bound"
        return (
            f"a line of the request is over {bound} (the bound of each request line, header line, "
            "chunk-size line and trailer line)"
        )
    message = str(error.message)
    if isinstance(error, BadHttpMethod) and message == _TLS_ON_HTTP:
        return message
    if (llhttp := _LLHTTP.fullmatch(message.removeprefix(_STATUS_LINE_PREFIX))) is not None:
        return " ".join(llhttp["reason"].split())[:MAX_REASON_CHARS]
    return next((kind for cls, kind in _KINDS if isinstance(error, cls)), NOT_HTTP)


def body_reason_of(error: RequestPayloadError | HttpProcessingError) -> str:
    """The reason a body's read failed, with none of its bytes: a RequestPayloadError is aiohttp's
    wrapping of the parser's failure (its `__cause__`), its own text that failure's message."""
    cause = error.__cause__ if isinstance(error, RequestPayloadError) else error
    return reason_of(cause) if isinstance(cause, HttpProcessingError) else BODY_NOT_READ
