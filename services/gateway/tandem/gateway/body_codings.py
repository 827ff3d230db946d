"""The codings a request body may come in: the content codings the gateway decodes (gzip, its alias
x-gzip, deflate; br and zstd where their libraries are installed), identity, or none, one at most; and
the chunked transfer coding alone.

NOTE: why a body's coding is checked before it is read. aiohttp decodes a Content-Encoding only when
the whole header is one coding it knows, and reads any other body as plain bytes: `Content-Encoding:
foo` over plain JSON was answered 200, `x-gzip` or `gzip, gzip` over gzip "body is not valid JSON";
it drops every transfer coding but the last chunked, so `Transfer-Encoding: gzip, chunked` was read as
its compressed bytes. So a Content-Encoding is taken only as aiohttp would read it, one line holding
one coding and nothing else: `gzip,`, `, gzip` or a second, empty line after `gzip` over gzip were
"body is not valid JSON". A coding the gateway does not decode is refused instead: 415 naming
Content-Encoding, with Accept-Encoding saying what is (RFC 9110 15.5.16), or 400 naming
Transfer-Encoding (RFC 9112 6.1 suggests 501; OpenAI's clients retry a 5xx, and no retry mends this).

NOTE: why bodies are decoded here, never by aiohttp's parser (the server's `auto_decompress` is off:
`OpenAIRequestHandler`, and the app's handler arguments for any other server). aiohttp's parser decodes
a body as its bytes arrive, before any handler has looked at the request: a caller with no token had its
gzip decoded (up to a MiB of a bomb) before its 401; one naming br or zstd, whose library is not
installed, was refused at the head, the head dropped, so a 415 went to a caller with no token before
its 401 (telling an anonymous caller how bodies are read); and what is left of a body after its answer
was decoded as aiohttp drained it (its lingering read), piece after piece without a turn for the loop:
a 401 over 64 KiB of gzip held every other caller for the 64 MiB it decodes to (266-623 ms). Decoded
here (`DecodedBody`), a body is decoded only as an authenticated handler reads it, in pieces of the size
aiohttp's are (`PIECE_BYTES`) with a turn for the loop between them, bounded by what it decodes to
(--max-body-bytes, counted after each piece) and by aiohttp's cap on concatenated members, with
aiohttp's own decompressors; bytes that do not decode fail its reader as aiohttp's (400, the
connection closed). What is left of a body after its answer is its coded bytes, which aiohttp's drain
reads without decoding. x-gzip is read as gzip (RFC 9110 8.4.1.3 says a recipient SHOULD), which
aiohttp's parser did not know.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from aiohttp import HttpVersion, HttpVersion11, StreamReader
from aiohttp.compression_utils import (
    HAS_BROTLI,
    HAS_ZSTD,
    BrotliDecompressor,
    ZLibDecompressor,
    ZSTDDecompressor,
)
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDictProxy

from tandem.gateway.errors import HttpError

# The content codings the gateway decodes, as aiohttp spells them (any case): br and zstd only where
# their libraries are installed.
CONTENT_CODINGS = ("gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())
# gzip's alias (RFC 9110 8.4.1.3), decoded as gzip, not named where the codings decoded are listed: a
# caller is told the coding's name, not its alias.
X_GZIP = "x-gzip"
# The most one decompression gives at a time: aiohttp's for a gzip body (its default read_bufsize).
PIECE_BYTES = 2**18


def coding_refusal(headers: CIMultiDictProxy[str]) -> HttpError | None:
    """The refusal of a body sent in a content coding the gateway does not decode, or None."""
    # Lines are one comma-separated list (RFC 9110 5.3), shown as such: `identity` then `gzip` is
    # `identity, gzip`, a second coding, refused as that one line would be.
    content = headers.getall("Content-Encoding", ())
    if len(content) > 1 or (content and not _is_decoded(content[0])):
        return _content_refusal(", ".join(content))
    return None


def framing_refusal(headers: CIMultiDictProxy[str], version: HttpVersion) -> HttpError | None:
    """The refusal of a request whose Transfer-Encoding is anything but `chunked` alone, or None.

    NOTE: why this comes first, before the token is checked, and closes the connection unread. A
    transfer coding is the message's framing (RFC 9112 6), not its content: where it is not `chunked`
    alone, where the body ends is not known for sure, and whatever follows on the connection may be
    read by a proxy in front as another request than the gateway reads (request smuggling). aiohttp's
    C parser refuses most such heads itself (two Transfer-Encoding lines, `chunked` twice or not last,
    one beside Content-Length: its 400, before any handler), but read `identity, chunked` or
    `gzip, chunked` as chunked, an empty line as no body at all (the chunks after it parsed as the next
    request), and its pure-Python one `chunked, chunked` as chunked: each was answered, its body
    drained and the connection kept for the next request, a 400 only where an endpoint read the body.
    The one line is compared whole, not as a list: `,chunked`, its empty item dropped, was chunked.
    So every such request is the parser's kind of refusal, answered before anything else, and nothing
    after its head is read as HTTP (RFC 9112 6.3: 400, then close). HTTP/1.0 has no transfer codings:
    one that names any is framed as no HTTP/1.0 sender means (RFC 9112 6.1)."""
    lines = headers.getall("Transfer-Encoding", ())
    if not lines:
        return None
    shown = ", ".join(line.strip(" \t") for line in lines)[:64] or "(empty)"
    if version < HttpVersion11:
        message = f"Transfer-Encoding: {shown} in an HTTP/1.0 request, which has no transfer codings"
        return HttpError(400, "invalid_request_error", message, "Transfer-Encoding")
    if len(lines) > 1 or lines[0].strip(" \t").lower() != "chunked":
        message = f"Transfer-Encoding: {shown} is not one the gateway reads: chunked alone"
        return HttpError(400, "invalid_request_error", message, "Transfer-Encoding")
    return None


def coding_of(headers: CIMultiDictProxy[str]) -> str | None:
    """The content coding the body is to be decoded from (one of CONTENT_CODINGS, or X_GZIP), None for a
    body sent as it is; `coding_refusal` has refused any other spelling than one line holding one."""
    coding = headers.get("Content-Encoding", "").strip(" \t").lower()
    return coding if coding in (*CONTENT_CODINGS, X_GZIP) else None


class DecodedBody:
    """A body sent in a content coding, decoded as it is read (the module's NOTE): `readany` gives the
    next decoded bytes, at most PIECE_BYTES at a time, b"" at the end.

    NOTE: why its reader is told of each coded piece taken (`on_coded`). Coded bytes may decode to
    nothing (empty deflate stored blocks, empty gzip members), and `readany` takes more until they give
    something: bounded by what they decoded to alone, 200 MiB of them were taken against a 64 KiB
    --max-body-bytes (answered 200), and a reader whose idle timer heard only of decoded bytes timed
    out a body arriving every second (408). The reader bounds and times the coded bytes as they come
    instead; what it raises ends the read."""

    def __init__(self, content: StreamReader, coding: str, on_coded: Callable[[int], None]) -> None:
        self._content = content  # the body's bytes as they came, coded
        self._coding = coding  # one of CONTENT_CODINGS, or X_GZIP: named so where it fails
        self._on_coded = on_coded  # told the coded bytes taken so far, after each piece
        self._decompressor = _decompressor(coding)
        self._num_coded = 0  # coded bytes taken so far

    def is_eof(self) -> bool:
        """Whether the whole body has come and been decoded: that its coded bytes came says only that,
        maybe none of them decoded."""
        return self._content.at_eof() and not self._decompressor.data_available

    async def readany(self) -> bytes:
        while True:
            if self._decompressor.data_available:
                if piece := self._decompress(b""):  # what the last bytes held beyond one piece
                    return piece
            coded = await self._content.readany()
            if not coded:
                # As aiohttp ends them: a deflate stream cut short fails, a gzip member cut short ends.
                if self._coding == "deflate" and self._num_coded and not self._decompressor.eof:
                    self._fail(None)
                return b""
            if not self._num_coded and self._coding == "deflate" and coded[0] & 0xF != 8:
                # Deflate without its zlib header (RFC 1950's CM is not 8), as some clients send it:
                # aiohttp reads it so too.
                self._decompressor = ZLibDecompressor(encoding="deflate", suppress_deflate_header=True)
            self._num_coded += len(coded)
            self._on_coded(self._num_coded)
            if piece := self._decompress(coded):
                return piece

    def _decompress(self, coded: bytes) -> bytes:
        try:
            return self._decompressor.decompress_sync(coded, max_length=PIECE_BYTES)
        except Exception as error:  # as aiohttp's reader: whatever fails, the bytes are the caller's
            self._fail(error)

    def _fail(self, error: Exception | None) -> NoReturn:
        # The failure aiohttp gives a coded body's reader, which then cannot be drained.
        reason = ContentEncodingError(f"Can not decode content-encoding: {self._coding}")
        failure = RequestPayloadError(str(reason))
        self._content.set_exception(failure, error)
        raise failure from error


def _decompressor(coding: str) -> ZLibDecompressor | BrotliDecompressor | ZSTDDecompressor:
    if coding == "br":
        return BrotliDecompressor()
    if coding == "zstd":
        return ZSTDDecompressor()
    return ZLibDecompressor(encoding="gzip" if coding == X_GZIP else coding)


def is_body_left(body: StreamReader | DecodedBody) -> bool:
    """Whether some of the body its reader (`body`: the request's, or its `DecodedBody`) gives has not
    been read: its bytes may still be coming, or be decoded and not yet taken."""
    return not body.is_eof()


def _content_refusal(shown: str) -> HttpError:
    accepted = ", ".join(CONTENT_CODINGS)
    coding = shown.strip(" \t")[:64]
    message = (
        f"Content-Encoding: {coding} is not a coding the gateway decodes: one of {accepted}, or identity"
    )
    return HttpError(
        415,
        "invalid_request_error",
        message,
        "Content-Encoding",
        more_headers=(("Accept-Encoding", accepted),),
    )


def _is_decoded(value: str) -> bool:
    """Whether the gateway decodes a body whose one Content-Encoding line is `value`, or reads it as it
    is where it should: the whole line is compared, as aiohttp compared it, so `gzip,` or `, gzip` (one
    coding by RFC 9110) is refused rather than read as its compressed bytes."""
    coding = value.strip(" \t")
    return coding.isascii() and coding.lower() in ("", "identity", X_GZIP, *CONTENT_CODINGS)
