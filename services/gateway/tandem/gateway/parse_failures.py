"""What the gateway says of a request aiohttp's parser refused: its reason, never the caller's bytes.

NOTE: why aiohttp's own message is not said. Its parser quotes what it failed on: a header line over
8,190 bytes its first 100 (`Authorization: Bearer xxxx...`), a header value with a control character
the whole line, llhttp's failures the bytes around the failing one. That went into the caller's 400 and
into the gateway's log at INFO, a bearer token with it, where tokens never show in logs (SECURITY.md).
So the reason is named without them: llhttp's description (the text before its quoted bytes), the
bound a line went over, or the kind of failure where aiohttp's message is the caller's bytes.
"""

from __future__ import annotations

from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestPayloadError

# llhttp's failures (aiohttp's C parser) read "<description>:\n\n  <the bytes>\n  <a caret>", the
# request line's behind this prefix.
_LLHTTP_BYTES = ":\n"
_STATUS_LINE_PREFIX = "Bad status line:\n  "
# aiohttp's HTTPS-on-an-HTTP-port message: the one BadHttpMethod that quotes nothing.
_TLS_ON_HTTP = "Received HTTPS traffic on an HTTP port"
MAX_REASON_CHARS = 200
# A body's failure that carries no parser failure (a coding the gateway decodes itself: body_codings).
BODY_NOT_READ = "the body's bytes are not what its framing or its Content-Encoding says"


def reason_of(error: HttpProcessingError) -> str:
    """`error`'s reason, with none of the bytes the caller sent."""
    if isinstance(error, LineTooLong):
        limit = error.args[1] if len(error.args) > 1 else "the limit of"
        return f"a line of the request is over {limit} bytes (the bound of a request line and a header line)"
    message = str(error.message).removeprefix(_STATUS_LINE_PREFIX)
    if _LLHTTP_BYTES in message:
        message = message.partition(_LLHTTP_BYTES)[0]
    elif isinstance(error, BadHttpMethod) and message != _TLS_ON_HTTP:
        message = "the request line's method is not HTTP"  # aiohttp's pure-Python parser quotes it
    elif isinstance(error, BadStatusLine):
        message = "the request line is not HTTP"
    elif isinstance(error, InvalidHeader):
        message = "a header is not HTTP (its name, or a character its value may not hold)"
    elif isinstance(error, InvalidURLError):
        message = "the request target is not a URL"
    elif isinstance(error, TransferEncodingError):
        message = "a chunked body's framing is not HTTP"
    return " ".join(message.split())[:MAX_REASON_CHARS]


def body_reason_of(error: RequestPayloadError | HttpProcessingError) -> str:
    """The reason a body's read failed, with none of its bytes: a RequestPayloadError is aiohttp's
    wrapping of the parser's failure (its `__cause__`), its own text that failure's message."""
    cause = error.__cause__ if isinstance(error, RequestPayloadError) else error
    return reason_of(cause) if isinstance(cause, HttpProcessingError) else BODY_NOT_READ
