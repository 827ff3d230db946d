"""The codings a request body may come in: the content codings aiohttp decodes (gzip, deflate; br and
zstd where their libraries are installed), x-gzip, identity, or none, one at most; and the chunked
transfer coding alone.

NOTE: why a body's coding is checked before it is read. aiohttp decodes a Content-Encoding only when
the whole header is one coding it knows, and reads any other body as plain bytes: `Content-Encoding:
foo` over plain JSON was answered 200, `x-gzip` or `gzip, gzip` over gzip "body is not valid JSON";
it drops every transfer coding but the last chunked, so `Transfer-Encoding: gzip, chunked` was read as
its compressed bytes. So a Content-Encoding is taken only as aiohttp reads it, one line holding one
coding and nothing else: `gzip,`, `, gzip` or a second, empty line after `gzip` over gzip were "body is
not valid JSON". A coding the gateway does not decode is refused instead: 415 naming
Content-Encoding, with Accept-Encoding saying what is (RFC 9110 15.5.16), or 400 naming
Transfer-Encoding (RFC 9112 6.1 suggests 501; OpenAI's clients retry a 5xx, and no retry mends this).

NOTE: why x-gzip is decoded here, not by aiohttp. RFC 9110 8.4.1.3 says a recipient SHOULD read x-gzip
as gzip; aiohttp's parser knows only `gzip` and hands an x-gzip body over as its compressed bytes. So
`XGzipReader` gunzips them with aiohttp's own gzip decompressor, in pieces of the size aiohttp's are
(`PIECE_BYTES`): the body is bounded as a gzip body is, by what it decodes to (--max-body-bytes, counted
after each piece) and by aiohttp's cap on concatenated members, and bytes that do not decode fail its
reader as a gzip body's do (400, the connection closed).

NOTE: why a body left unread in a coding aiohttp decodes is not drained. aiohttp drains what is left of
a body after the answer (its lingering read) before it reuses or closes the connection, and decodes it
as it drains, piece after piece without letting the loop run: a 401 to a caller with no token over 64
KiB of gzip held every other caller for the 64 MiB it decodes to (266-623 ms). So an answer that leaves
such a body (`BodyLeft.CODED`) says `Connection: close`, and what more comes of the body is read and
dropped undecoded for the drain's time, as nginx drops a body it will not read: closed at once instead,
a caller still sending would read a reset rather than the answer. What is left undecoded (plain bytes,
or x-gzip's compressed ones, which aiohttp does not decode) is drained as before (`BodyLeft.RAW`): it
costs the reads alone.
"""

from __future__ import annotations

import enum

from aiohttp import StreamReader
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD, ZLibDecompressor
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDictProxy

from tandem.gateway.errors import HttpError

# The content codings aiohttp's request parser knows, and those it decodes here, as it spells them (any
# case): br and zstd only where their libraries are installed.
PARSED_CODINGS = ("gzip", "deflate", "br", "zstd")
CONTENT_CODINGS = ("gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())
# gzip's alias (RFC 9110 8.4.1.3), decoded by the gateway (XGzipReader), not named where the codings
# decoded are listed: a caller is told the coding's name, not its alias.
X_GZIP = "x-gzip"
# The most one decompression gives at a time: aiohttp's for a gzip body (its default read_bufsize).
PIECE_BYTES = 2**18


def coding_refusal(headers: CIMultiDictProxy[str]) -> HttpError | None:
    """The refusal of a body sent in a coding the gateway does not decode, or None."""
    # Lines are one comma-separated list (RFC 9110 5.3), shown as such: `identity` then `gzip` is
    # `identity, gzip`, a second coding, refused as that one line would be.
    content = headers.getall("Content-Encoding", ())
    if len(content) > 1 or (content and not _is_decoded(content[0])):
        return _content_refusal(", ".join(content))
    transfer = _codings(headers.getall("Transfer-Encoding", ()))
    if transfer and transfer != ["chunked"]:
        message = f"Transfer-Encoding: {_shown(transfer)} is not one the gateway reads: chunked alone"
        return HttpError(400, "invalid_request_error", message, "Transfer-Encoding")
    return None


def is_x_gzip(headers: CIMultiDictProxy[str]) -> bool:
    """Whether a body is in x-gzip, which the gateway decodes itself (XGzipReader); `coding_refusal`
    has refused any other spelling than one line holding that one coding."""
    return headers.get("Content-Encoding", "").strip(" \t").lower() == X_GZIP


class BodyLeft(enum.Enum):
    """What is left of a body its answer did not read, and so how its connection ends (the module's
    NOTE)."""

    NONE = "none"  # the whole body came (and was decoded): the connection is kept for the next request
    RAW = "raw"  # bytes aiohttp drains as they came, after the answer
    CODED = "coded"  # bytes aiohttp would decode to drain them: dropped undecoded, then closed


def body_left(headers: CIMultiDictProxy[str], body: StreamReader | XGzipReader) -> BodyLeft:
    """What is left of `body`, the request's reader (`XGzipReader` where it made one), unread."""
    if body.is_eof():
        return BodyLeft.NONE
    # Any line, not the one aiohttp reads: its C parser decodes by the last line and its pure-Python one
    # by the first, so `identity` then `gzip` was drained as RAW while decoded (a 401 over a 64 KiB gzip
    # bomb held the loop 221-1001 ms). More than one line is refused (415, `coding_refusal`) whatever
    # the body holds, so closing the connection where only some line names a coding costs nothing.
    lines = headers.getall("Content-Encoding", ())
    is_coded = any(line.isascii() and line.lower() in PARSED_CODINGS for line in lines)
    return BodyLeft.CODED if is_coded else BodyLeft.RAW


class XGzipReader:
    """A body sent in x-gzip, read as aiohttp reads one sent in gzip (the module's NOTE): `readany` gives
    the next decoded bytes, at most PIECE_BYTES at a time, b"" at the end."""

    def __init__(self, content: StreamReader) -> None:
        self._content = content  # the body's bytes as they came, compressed
        self._decompressor = ZLibDecompressor(encoding="gzip")

    def is_eof(self) -> bool:
        """Whether the whole body has come and been decoded, as `is_eof` of aiohttp's reader of a gzip
        body tells: the compressed stream's says only that its bytes came, maybe none of them decoded."""
        return self._content.at_eof() and not self._decompressor.data_available

    async def readany(self) -> bytes:
        while True:
            if self._decompressor.data_available:
                if piece := self._decompress(b""):  # what the last bytes held beyond one piece
                    return piece
            compressed = await self._content.readany()
            if not compressed:
                return b""  # a member cut short ends the body, as aiohttp ends a gzip one
            if piece := self._decompress(compressed):
                return piece

    def _decompress(self, compressed: bytes) -> bytes:
        try:
            return self._decompressor.decompress_sync(compressed, max_length=PIECE_BYTES)
        except Exception as error:  # as aiohttp's gzip reader: whatever fails, the bytes are the caller's
            # The failure aiohttp gives a gzip body's reader, which then cannot be drained.
            failure = RequestPayloadError(
                str(ContentEncodingError(f"Can not decode content-encoding: {X_GZIP}"))
            )
            self._content.set_exception(failure, error)
            raise failure from error


def parser_refusal(error: ContentEncodingError) -> HttpError | None:
    """The refusal of a coding aiohttp knows but cannot decode here (br without Brotli, zstd without its
    library), or None. Its parser raises it at the request's head, before any handler sees the request
    and with the head dropped (a 400 "Can not decode content-encoding: brotli (br). Please install
    `Brotli`", no param): the coding is read from those words.

    NOTE: why it comes before the 401 of a caller with no accepted token (every other refusal comes
    after it). The head is dropped before the gateway sees it, so no token can be read: the choice was
    this 415 to every caller or aiohttp's 400 to every caller, a token or not. The 415 says only which
    codings the gateway decodes (what its Accept-Encoding tells any caller), costs no work, and the
    connection is closed unread; the 400 would leave a caller with a good token not knowing why."""
    for coding in PARSED_CODINGS:
        if coding not in CONTENT_CODINGS and f"({coding})" in str(error.message):
            return _content_refusal(coding)
    return None


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
    """Whether aiohttp decodes a body whose one Content-Encoding line is `value`, or reads it as it is
    where it should: aiohttp compares the whole line, so `gzip,` or `, gzip` (one coding by RFC 9110)
    is read as its compressed bytes."""
    coding = value.strip(" \t")
    return coding.isascii() and coding.lower() in ("", "identity", X_GZIP, *CONTENT_CODINGS)


def _codings(values: list[str]) -> list[str]:
    """The codings of a header's lines, in order (RFC 9110 5.3: lines are a comma-separated list)."""
    return [c.strip(" \t").lower() for value in values for c in value.split(",") if c.strip(" \t")]


def _shown(codings: list[str]) -> str:
    return ", ".join(codings)[:64] or "(empty)"
