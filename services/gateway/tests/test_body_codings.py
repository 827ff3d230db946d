"""A body comes in a coding the gateway decodes (Content-Encoding gzip, its alias x-gzip, or deflate, any
case; identity or none; chunked alone), or it is refused before it is read: 415 naming Content-Encoding
with Accept-Encoding saying which are decoded, 400 naming Transfer-Encoding. aiohttp read every other
coding as plain bytes: `Content-Encoding: foo` over plain JSON was answered 200, and `gzip, gzip` over
gzip "the body is not valid JSON". A coded body gives the loop a turn between the pieces it decodes to,
and an answer that leaves some of one aiohttp would decode drops the rest undecoded and closes its
connection."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import zlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import http_parser
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD, ZLibDecompressor

from tandem.gateway.body_codings import CONTENT_CODINGS, PIECE_BYTES

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, read_to_close, send

BODY = json.dumps({"model": "", "prompt": "hi", "max_tokens": 2}).encode()
MIB = 2**20
# 8 MiB of blanks before the body in 8 KiB of gzip: JSON still, decoded in 32 pieces.
BOMB = gzip.compress(b" " * 8 * MIB + BODY, compresslevel=9)
LINGERING_S = 0.2  # aiohttp's drain of a body left unread, then the close: within `_answered`'s 1 s


class _Decoded:
    """What gzip's decompressor (aiohttp's, and x-gzip's reader's) has given: its bytes in all, and the
    most it gave between two turns of the event loop, for which every other caller waited."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.num_bytes = 0
        self.max_bytes_between_turns = 0
        decompress = ZLibDecompressor.decompress_sync

        def counted(decompressor: ZLibDecompressor, *args: object, **kwargs: object) -> bytes:
            piece = decompress(decompressor, *args, **kwargs)
            self.num_bytes += len(piece)
            return piece

        monkeypatch.setattr(ZLibDecompressor, "decompress_sync", counted)

    @contextlib.asynccontextmanager
    async def turns(self) -> AsyncIterator[None]:
        async def take_turns() -> None:
            while True:
                before = self.num_bytes
                await asyncio.sleep(0)
                self.max_bytes_between_turns = max(self.max_bytes_between_turns, self.num_bytes - before)

        task = asyncio.create_task(take_turns())
        try:
            yield
        finally:
            task.cancel()


async def _post(url: str, encoding: str, data: bytes) -> tuple[int, dict, str | None]:
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/completions", data=data, headers=headers) as response,
    ):
        return response.status, json.loads(await response.text()), response.headers.get("Accept-Encoding")


@pytest.mark.parametrize(
    ("encoding", "data"),
    [
        ("foo", BODY),  # was read as plain JSON: 200
        ("gzip, gzip", gzip.compress(gzip.compress(BODY))),  # was decoded once: not valid JSON
        ("gzip, identity", gzip.compress(BODY)),
        ("x-gzip, identity", gzip.compress(BODY)),
    ],
    ids=["foo", "gzip twice", "gzip then identity", "x-gzip then identity"],
)
async def test_a_content_coding_the_gateway_does_not_decode_is_415_saying_which_it_does(
    encoding: str, data: bytes
) -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, answer, accepted = await _post(url, encoding, data)
    error = answer["error"]
    assert (status, error["param"], accepted) == (415, "Content-Encoding", ", ".join(CONTENT_CODINGS))
    assert error["message"] == (
        f"Content-Encoding: {encoding} is not a coding the gateway decodes: one of "
        f"{', '.join(CONTENT_CODINGS)}, or identity"
    )
    assert decoder.requests == []


async def _raw_post(url: str, head_lines: bytes, data: bytes) -> tuple[int, dict]:
    sock = await connect(url)
    try:
        await send(sock, COMPLETIONS_HEAD + head_lines + b"Content-Length: %d\r\n\r\n" % len(data) + data)
        return await read_answer(sock, 5)
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("head_lines", "shown"),
    [
        (b"Content-Encoding: ,gzip\r\n", ",gzip"),
        (b"Content-Encoding: gzip,\r\n", "gzip,"),
        (b"Content-Encoding: , gzip, \r\n", ", gzip,"),
        (b"Content-Encoding: gzip\r\nContent-Encoding: \r\n", "gzip,"),
        (b"Content-Encoding: \r\nContent-Encoding: gzip\r\n", ", gzip"),
        (b"Content-Encoding: identity\r\nContent-Encoding: gzip\r\n", "identity, gzip"),
    ],
    ids=[
        "comma before",
        "comma after",
        "commas around",
        "gzip then empty line",
        "empty line then gzip",
        "identity then gzip",
    ],
)
async def test_a_content_coding_aiohttp_would_not_decode_as_spelled_is_415(
    head_lines: bytes, shown: str
) -> None:
    # One coding by RFC 9110's list rule, but aiohttp compares the whole line (the last line, with two):
    # the first four were read as their gzip bytes, "body: is not valid JSON ... byte 0x8b". Lines are
    # shown as the one list they make.
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, answer = await _raw_post(url, head_lines, gzip.compress(BODY))
    assert (status, answer["error"]["param"]) == (415, "Content-Encoding")
    assert answer["error"]["message"].startswith(f"Content-Encoding: {shown} is not a coding the gateway ")
    assert decoder.requests == []


@pytest.mark.skipif(HAS_BROTLI and HAS_ZSTD, reason="aiohttp decodes both here")
async def test_a_content_coding_aiohttp_knows_but_cannot_decode_here_is_415_not_its_parsers_400() -> None:
    # aiohttp refuses it in its parser, before any handler: 400 "Can not decode content-encoding: brotli
    # (br). Please install `Brotli`", no param, no Accept-Encoding; the same with Expect: 100-continue.
    missing = "br" if not HAS_BROTLI else "zstd"
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        for expect in (b"", b"Expect: 100-continue\r\n"):
            status, answer = await _raw_post(
                url, b"Content-Encoding: %s\r\n" % missing.encode() + expect, BODY
            )
            assert (status, answer["error"]["param"]) == (415, "Content-Encoding")
            assert answer["error"]["message"] == (
                f"Content-Encoding: {missing} is not a coding the gateway decodes: one of "
                f"{', '.join(CONTENT_CODINGS)}, or identity"
            )
    assert decoder.requests == []


@pytest.mark.skipif(HAS_BROTLI and HAS_ZSTD, reason="aiohttp decodes both here")
async def test_a_coding_aiohttp_refuses_at_the_head_is_415_before_the_token_is_checked() -> None:
    # Its head is dropped before the gateway sees it: no token to read (parser_refusal's NOTE).
    missing = "br" if not HAS_BROTLI else "zstd"
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, auth_tokens=frozenset({"sekret"})) as url,
    ):
        status, answer = await _raw_post(url, b"Content-Encoding: %s\r\n" % missing.encode(), BODY)
    assert (status, answer["error"]["param"]) == (415, "Content-Encoding")
    assert decoder.requests == []


async def test_the_codings_the_gateway_decodes_are_read_in_any_case() -> None:
    cases = [("gzip", gzip.compress(BODY)), ("GZip", gzip.compress(BODY)), ("deflate", zlib.compress(BODY))]
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        for encoding, data in [*cases, ("identity", BODY), ("", BODY)]:
            status, answer, _ = await _post(url, encoding, data)
            assert (status, answer["choices"][0]["text"]) == (200, "<hi> seed=none"), encoding
    assert len(decoder.requests) == 5


@pytest.mark.parametrize(
    "data",
    [
        gzip.compress(BODY),
        gzip.compress(BODY) * 3,  # concatenated members, read as one body
        gzip.compress(json.dumps({"model": "", "prompt": "x" * 10_000}).encode()),  # over 4,096 decoded
        b"abcde",  # not gzip, though it says so
    ],
    ids=["one member", "three members", "over the bound decoded", "not gzip"],
)
async def test_an_x_gzip_body_is_answered_as_the_same_body_in_gzip(data: bytes) -> None:
    # RFC 9110 8.4.1.3: x-gzip is gzip's alias. It was 415, "not a coding the gateway decodes".
    answers = {}
    async with fake_decoder() as (decoder, address), live_gateway(address, max_body_bytes=4096) as url:
        for encoding in ("gzip", "x-gzip", "X-GZip"):
            status, answer = await _raw_post(url, b"Content-Encoding: %s\r\n" % encoding.encode(), data)
            said = json.dumps(answer.get("error") or answer["choices"])  # the coding's name aside
            answers[encoding] = (status, re.sub(f"(?i)content-encoding: {encoding}", "(coding)", said))
    assert answers["x-gzip"] == answers["X-GZip"] == answers["gzip"], answers
    assert answers["gzip"][0] in (200, 400, 413)


@pytest.mark.parametrize("encoding", [b"gzip", b"x-gzip"])
async def test_a_body_is_decoded_a_few_pieces_between_turns_of_the_loop(
    encoding: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both handed out every piece decoded from bytes already come without a turn between: 8 MiB.
    decoded = _Decoded(monkeypatch)
    bounds = {"max_body_bytes": 16 * MIB, "large_body_bytes": 16 * MIB}  # parsed here, not in a worker
    async with fake_decoder() as (_, address), live_gateway(address, **bounds) as url, decoded.turns():
        status, _ = await _raw_post(url, b"Content-Encoding: %s\r\n" % encoding, BOMB)
    assert status == 200 and decoded.num_bytes > 8 * MIB
    assert decoded.max_bytes_between_turns <= 4 * PIECE_BYTES


async def _answered(head: bytes, data: bytes, url: str) -> tuple[int, bool]:
    """The status of the answer to `head` and `data`, and whether the gateway said `Connection: close`
    and closed the connection within 1 s of it (0 and False when it kept it)."""
    sock = await connect(url)
    try:
        await send(sock, head + b"Content-Length: %d\r\n\r\n" % len(data) + data)
        sent = await read_to_close(sock, 1)
    except TimeoutError:
        return 0, False
    finally:
        sock.close()
    head, _, _ = sent.partition(b"\r\n\r\n")
    return int(head.split()[1]), b"connection: close" in head.lower()


@pytest.mark.parametrize("encoding", [b"gzip", b"x-gzip"])
async def test_a_body_is_413_once_what_it_decodes_to_passes_the_bound_and_the_rest_is_not_decoded(
    encoding: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a 1 MiB bound. x-gzip's 413 kept the connection (its compressed bytes had all come), and
    # gzip's rest was decoded whole by aiohttp's drain after the answer, the loop held meanwhile.
    decoded = _Decoded(monkeypatch)
    settings = {"max_body_bytes": MIB, "lingering_s": LINGERING_S}
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        answered = await _answered(COMPLETIONS_HEAD + b"Content-Encoding: %s\r\n" % encoding, BOMB, url)
    assert answered == (413, True)
    assert decoded.num_bytes <= 3 * MIB  # of 8
    assert decoder.requests == []


@pytest.mark.parametrize(
    ("head", "status"),
    [
        pytest.param(COMPLETIONS_HEAD, 401, id="no token"),
        pytest.param(COMPLETIONS_HEAD + b"Expect: 100-continue\r\n", 401, id="no token, sent unasked"),
        pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\n", 200, id="health"),
        pytest.param(b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n", 404, id="404"),
    ],
)
async def test_an_answer_leaving_a_gzip_body_unread_closes_its_connection_rather_than_decode_it(
    head: bytes, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp's drain after the answer decoded the whole body without a turn for the loop (266-623 ms
    # for 64 MiB), for callers with no token among others, then kept the connection.
    decoded = _Decoded(monkeypatch)
    settings = {"auth_tokens": frozenset({"a"}), "lingering_s": LINGERING_S}
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        answered = await _answered(head + b"Content-Encoding: gzip\r\n", BOMB, url)
    assert answered == (status, True)
    assert decoded.num_bytes <= MIB  # of 8: what aiohttp decodes as the body comes, before it waits
    assert decoder.requests == []


@pytest.mark.parametrize(
    ("lines", "token", "status"),
    [
        pytest.param((b"identity", b"gzip"), False, 401, id="identity then gzip, no token"),
        pytest.param((b"identity", b"gzip"), True, 415, id="identity then gzip, 415"),
        pytest.param((b"", b"gzip"), False, 401, id="empty line then gzip, no token"),
    ],
)
async def test_an_answer_leaving_a_body_unread_closes_its_connection_whichever_line_aiohttp_decodes_by(
    lines: tuple[bytes, ...], token: bool, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp's C parser decodes by the last line: `identity` then `gzip` was taken by the first, drained
    # decoded with the connection kept (a 64 MiB bomb held the loop 221-1001 ms after a 401, 237-280 ms
    # after the 415). Its pure-Python parser (AIOHTTP_NO_EXTENSIONS) decodes by the first line: these
    # bodies are plain bytes to it, all come, and the connection is kept.
    decoded = _Decoded(monkeypatch)
    settings = {"auth_tokens": frozenset({"a"}), "lingering_s": LINGERING_S}
    head = COMPLETIONS_HEAD + (b"Authorization: Bearer a\r\n" if token else b"")
    head += b"".join(b"Content-Encoding: %s\r\n" % line for line in lines)
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        answered = await _answered(head, BOMB, url)
    decodes_by_last_line = http_parser.HttpRequestParser is not http_parser.HttpRequestParserPy
    assert answered == ((status, True) if decodes_by_last_line else (0, False))
    assert decoded.num_bytes <= MIB
    assert decoder.requests == []


async def test_a_transfer_coding_besides_chunked_is_400_naming_transfer_encoding() -> None:
    # aiohttp took the last coding, chunked, and read the gzip bytes as the body.
    data = gzip.compress(BODY)
    chunked = b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        sock = await connect(url)
        try:
            await send(sock, COMPLETIONS_HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked)
            status, answer = await read_answer(sock, 5)
        finally:
            sock.close()
    assert (status, answer["error"]["param"]) == (400, "Transfer-Encoding")
    assert answer["error"]["message"] == (
        "Transfer-Encoding: gzip, chunked is not one the gateway reads: chunked alone"
    )
    assert decoder.requests == []
