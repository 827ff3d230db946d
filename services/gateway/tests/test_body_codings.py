"""A body comes in a coding the gateway decodes (Content-Encoding gzip, its alias x-gzip, or deflate, any
case; identity or none; chunked alone), or it is refused before it is read: 415 naming Content-Encoding
with Accept-Encoding saying which are decoded, 400 naming Transfer-Encoding. aiohttp read every other
coding as plain bytes: `Content-Encoding: foo` over plain JSON was answered 200, and `gzip, gzip` over
gzip "the body is not valid JSON". A coded body is decoded only by the handler that reads it, giving the
loop a turn between the pieces it decodes to: a caller refused before its body is read (a 401, a 404,
/health) has none of it decoded."""

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
async def test_a_coding_without_its_library_is_401_to_a_caller_with_no_token_and_415_to_one_with() -> None:
    # aiohttp's parser refused it at the head, the head dropped: a 415 before the token was checked,
    # telling a caller with no token how bodies are read.
    missing = b"br" if not HAS_BROTLI else b"zstd"
    statuses = []
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, auth_tokens=frozenset({"sekret"})) as url,
    ):
        for token in (b"", b"Authorization: Bearer sekret\r\n"):
            for expect in (b"", b"Expect: 100-continue\r\n"):
                status, answer = await _raw_post(
                    url, token + expect + b"Content-Encoding: %s\r\n" % missing, BODY
                )
                statuses.append((status, answer["error"]["param"]))
    assert statuses == [(401, None)] * 2 + [(415, "Content-Encoding")] * 2
    assert decoder.requests == []


async def test_the_codings_the_gateway_decodes_are_read_in_any_case() -> None:
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # deflate without its zlib header, as aiohttp reads it
    cases = [
        ("gzip", gzip.compress(BODY)),
        ("GZip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("deflate", raw.compress(BODY) + raw.flush()),
    ]
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        for encoding, data in [*cases, ("identity", BODY), ("", BODY)]:
            status, answer, _ = await _post(url, encoding, data)
            assert (status, answer["choices"][0]["text"]) == (200, "<hi> seed=none"), encoding
    assert len(decoder.requests) == 6


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
        pytest.param(COMPLETIONS_HEAD + b"Content-Encoding: identity\r\n", 401, id="identity then gzip"),
        pytest.param(
            COMPLETIONS_HEAD + b"Authorization: Bearer a\r\nContent-Encoding: identity\r\n",
            415,
            id="identity then gzip, 415",
        ),
    ],
)
async def test_an_answer_leaving_a_gzip_body_unread_decodes_none_of_it(
    head: bytes, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp's parser decoded the body as it came, before any handler, and its drain after the answer
    # the rest, without a turn for the loop (266-623 ms for 64 MiB; 221-1001 ms where `identity` came
    # first, its C parser decoding by the last line): for callers with no token among others.
    decoded = _Decoded(monkeypatch)
    settings = {"auth_tokens": frozenset({"a"}), "lingering_s": LINGERING_S}
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            await send(
                sock, head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(BOMB) + BOMB
            )
            answered, _ = await read_answer(sock, 5)
            await asyncio.sleep(2 * LINGERING_S)  # aiohttp's drain, had it decoded
        finally:
            sock.close()
    assert (answered, decoded.num_bytes) == (status, 0)
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


async def _sent_until_closed(head: bytes, rest: bytes, url: str) -> tuple[list[bytes], bool]:
    """The answers' heads the gateway sends to `head`, then `rest` a moment later (lower case), and
    whether it closed the connection within 1 s."""
    sock = await connect(url)
    try:
        await send(sock, head)
        await asyncio.sleep(0.05)  # the head parsed alone, as a proxy's may be
        await send(sock, rest)
        got, is_closed = b"", True
        try:
            got = await read_to_close(sock, 1)
        except TimeoutError:
            is_closed = False
            with contextlib.suppress(BlockingIOError):
                got = sock.recv(65536)
    finally:
        sock.close()
    starts = [m.start() for m in re.finditer(rb"HTTP/1\.[01] \d{3} ", got)]
    heads = [got[start:].split(b"\r\n\r\n")[0].lower() for start in starts]
    return heads, is_closed


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n"
CHUNKS = b"5\r\nhello\r\n0\r\n\r\n"
NEXT = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # what a proxy in front may take for the next request


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(HEALTH + b"Transfer-Encoding: identity, chunked\r\n", id="identity, chunked"),
        pytest.param(COMPLETIONS_HEAD + b"Transfer-Encoding: gzip, chunked\r\n", id="gzip, no token"),
        pytest.param(HEALTH + b"Transfer-Encoding: \r\n", id="empty: no body to aiohttp"),
        pytest.param(HEALTH.replace(b"1.1", b"1.0") + b"Transfer-Encoding: chunked\r\n", id="HTTP/1.0"),
        pytest.param(HEALTH + b"Transfer-Encoding: chunked, chunked\r\n", id="chunked twice"),
        pytest.param(HEALTH + b"Transfer-Encoding: ,chunked\r\n", id="an empty item, then chunked"),
        # aiohttp's own expect handler answered these 417 or `100 Continue` before any middleware ran.
        pytest.param(HEALTH + b"Transfer-Encoding: \r\nExpect: foo\r\n", id="empty, Expect: foo"),
        pytest.param(
            b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity, chunked\r\n"
            b"Expect: foo\r\n",
            id="404, Expect: foo",
        ),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
            b"Expect: 100-continue\r\n",
            id="GET, Expect: 100-continue",
        ),
        pytest.param(
            b"OPTIONS * HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \r\nExpect: foo\r\n", id="OPTIONS *, Expect"
        ),
        # An empty path reached no route: aiohttp's expect handler again, 417 and the next request answered.
        pytest.param(
            b"GET http://x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \r\nExpect: foo\r\n",
            id="no path, Expect",
        ),
        pytest.param(
            b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \r\nExpect: foo\r\n",
            id="CONNECT, Expect",
        ),
    ],
)
async def test_a_transfer_encoding_but_chunked_alone_is_400_first_and_nothing_after_its_head_is_read(
    head: bytes,
) -> None:
    # RFC 9112 6.3: where the framing is in doubt, 400 and close. aiohttp read the first two as chunked
    # and the third as no body (its chunks parsed as the next request), answered /health 200 or the
    # caller with no token 401, and kept the connection: the request after was answered too.
    settings = {"auth_tokens": frozenset({"a"}), "lingering_s": LINGERING_S}
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        heads, is_closed = await _sent_until_closed(head + b"\r\n", CHUNKS + NEXT, url)
    assert len(heads) == 1 and heads[0].split()[1] == b"400", heads
    # An HTTP/1.0 answer says nothing: its connection closes unless kept alive.
    assert is_closed and (b"connection: close" in heads[0] or heads[0].startswith(b"http/1.0"))
    assert decoder.requests == []


EMPTY_BLOCK = (
    b"\x00\x00\x00\xff\xff"  # a stored deflate block of no bytes: coded bytes that decode to nothing
)


def _deflate_around_empty_blocks(body: bytes) -> tuple[bytes, bytes]:
    """`body` in deflate cut after its first byte, where empty blocks may go: what comes before and after."""
    coder = zlib.compressobj(6, zlib.DEFLATED, 15)
    start = coder.compress(body[:1]) + coder.flush(zlib.Z_SYNC_FLUSH)
    return start, coder.compress(body[1:]) + coder.flush()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CODED_CHUNKED = COMPLETIONS_HEAD + b"Content-Encoding: deflate\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_a_coded_body_is_413_once_its_coded_bytes_pass_the_bound_whatever_they_decode_to() -> None:
    # 1 MiB of empty deflate blocks, chunked, against a 64 KiB bound: bounded by what it decoded to
    # alone, the gateway took all of it (200 MiB too) and answered 200.
    start, end = _deflate_around_empty_blocks(BODY)
    data = start + EMPTY_BLOCK * (MIB // len(EMPTY_BLOCK)) + end
    settings = {"max_body_bytes": 64 * 1024, "lingering_s": LINGERING_S}
    async with fake_decoder() as (decoder, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            await send(sock, CODED_CHUNKED + _chunk(data) + b"0\r\n\r\n")
            status, answer = await read_answer(sock, 5)
        finally:
            sock.close()
    assert (status, answer["error"]["param"]) == (413, "body")
    assert decoder.requests == []


async def test_coded_bytes_that_decode_to_nothing_yet_keep_the_body_from_being_idle() -> None:
    # An empty deflate block every 0.1 s for 0.6 s under a 0.3 s --body-idle-timeout-s: the timer heard
    # only of decoded bytes, and the body was 408 once 0.3 s had passed.
    start, end = _deflate_around_empty_blocks(BODY)
    settings = {"body_idle_timeout_s": 0.3, "body_timeout_s": 30.0}
    async with fake_decoder() as (_, address), live_gateway(address, **settings) as url:
        sock = await connect(url)
        try:
            await send(sock, CODED_CHUNKED + _chunk(start))
            for _ in range(6):
                await asyncio.sleep(0.1)
                await send(sock, _chunk(EMPTY_BLOCK))
            await send(sock, _chunk(end) + b"0\r\n\r\n")
            status, answer = await read_answer(sock, 5)
        finally:
            sock.close()
    assert status == 200 and answer["choices"][0]["text"]
