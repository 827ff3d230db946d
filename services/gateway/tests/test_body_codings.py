"""A body comes in a coding the gateway decodes (Content-Encoding gzip, its alias x-gzip, or deflate, any
case; identity or none; chunked alone), or it is refused before it is read: 415 naming Content-Encoding
with Accept-Encoding saying which are decoded, 400 naming Transfer-Encoding. aiohttp read every other
coding as plain bytes: `Content-Encoding: foo` over plain JSON was answered 200, and `gzip, gzip` over
gzip "the body is not valid JSON"."""

from __future__ import annotations

import gzip
import json
import re
import zlib

import aiohttp
import pytest
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD

from tandem.gateway.body_codings import CONTENT_CODINGS

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, send

BODY = json.dumps({"model": "", "prompt": "hi", "max_tokens": 2}).encode()


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
        (b"Content-Encoding: gzip\r\nContent-Encoding: \r\n", "2 header lines"),
        (b"Content-Encoding: \r\nContent-Encoding: gzip\r\n", "2 header lines"),
    ],
    ids=["comma before", "comma after", "commas around", "gzip then empty line", "empty line then gzip"],
)
async def test_a_content_coding_aiohttp_would_not_decode_as_spelled_is_415(
    head_lines: bytes, shown: str
) -> None:
    # One coding by RFC 9110's list rule, but aiohttp compares the whole line (the last line, with two):
    # the first four were read as their gzip bytes, "body: is not valid JSON ... byte 0x8b".
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


async def test_an_x_gzip_body_is_413_once_what_it_decodes_to_passes_the_bound() -> None:
    # 16 MiB of zeros in 16 KiB of gzip, over a 1 MiB bound: the bound is on the decoded bytes.
    bomb = gzip.compress(bytes(16 * 2**20), compresslevel=9)
    async with fake_decoder() as (decoder, address), live_gateway(address, max_body_bytes=2**20) as url:
        status, answer = await _raw_post(url, b"Content-Encoding: x-gzip\r\n", bomb)
    assert (status, answer["error"]["param"]) == (413, "body"), answer
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
