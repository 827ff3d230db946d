"""What the gateway guards itself: tokens (passed on to the services), a caller's open completions,
the body's size; and the errors of the services it translates (429 with Retry-After, 503)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest

from common.tests.ports import free_port
from tandem.common.server import ServerOptions
from tandem.decoder.models.loader import LoadedModel
from tandem.gateway.config import GatewayConfig
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.gateway.conftest import start_gateway, stop_gateway

TOKEN = "gateway-test-token"
CHAT = {"model": "", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4}


async def test_tokens_are_checked_and_passed_on_to_an_authenticated_decoder(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    decoder = await serve(tiny_model_dir, tiny_fp32)
    # The decoder itself checks the same token: the gateway's call only succeeds if it passes it on.
    await decoder.server.stop(0)
    from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
    from tandem.common.server import Service, start_server
    from tandem.decoder.api.servicer import DecoderServicer

    servicer = DecoderServicer(tiny_model_dir.name, 64 * 1024 * 1024, engine=decoder.engine)
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, auth_tokens=frozenset({TOKEN})),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    await server.set_serving()
    task, port = await start_gateway(
        GatewayConfig(decoder_address=server.address, port=0, auth_tokens=frozenset({TOKEN}))
    )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0) as client:
            reply = await client.chat.completions.create(**CHAT)
            assert reply.usage.completion_tokens == 4
        async with openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(**CHAT)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/health") as health,
        ):
            assert health.status == 200  # health needs no token
    finally:
        await stop_gateway(task)
        await server.stop(0)
        await shutdown(decoder)


async def test_a_callers_open_completions_are_bounded_and_the_rest_answered(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    decoder = await serve(tiny_model_dir, tiny_fp32)
    task, port = await start_gateway(
        GatewayConfig(decoder_address=decoder.server.address, port=0, max_streams_per_caller=2)
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = CHAT | {"max_tokens": 200, "stream": True, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as session:
            # Without tokens checked, a token says nothing: a new one per request is still the same caller.
            first = await session.post(url, json=body, headers={"Authorization": "Bearer a"})
            second = await session.post(url, json=body, headers={"Authorization": "Bearer b"})
            third = await session.post(url, json=body, headers={"Authorization": "Bearer c"})
            assert (first.status, second.status, third.status) == (200, 200, 429)
            assert third.headers["Retry-After"] == "1"
            error = (await third.json())["error"]
            assert error["type"] == "rate_limit_error" and "--max-streams-per-caller" in error["message"]
            for response in (first, second):
                assert (await response.text()).rstrip().endswith("data: [DONE]")
            fourth = await session.post(url, json=CHAT)  # the earlier ones closed: room again
            assert fourth.status == 200
    finally:
        await stop_gateway(task)
        await shutdown(decoder)


async def test_a_body_over_the_limit_is_413_and_malformed_json_is_400(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    decoder = await serve(tiny_model_dir, tiny_fp32)
    task, port = await start_gateway(
        GatewayConfig(decoder_address=decoder.server.address, port=0, max_body_bytes=4096)
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"model": "", "prompt": "x" * 10_000}) as response:
                assert response.status == 413
                assert "--max-body-bytes" in (await response.json())["error"]["message"]
            async with session.post(
                url, data=b"{not json", headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "body"
            for encoding in ("gzip", "deflate"):  # bytes that do not decompress: the caller's, a 400
                headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
                async with session.post(url, data=b'{"prompt": "hi"}', headers=headers) as r:
                    error = (await r.json())["error"]
                    assert r.status == 400 and error["param"] == "body", error
                    assert f"Content-Encoding: {encoding}" in error["message"]
            async with session.get(url) as r:  # RFC 9110: a 405 names the methods allowed
                assert r.status == 405 and r.headers["Allow"] == "POST"
            async with session.post(url, json={"model": "", "prompt": "hi", "max_tokens": 2}) as response:
                assert response.status == 200  # and it keeps serving
    finally:
        await stop_gateway(task)
        await shutdown(decoder)


async def test_a_decoder_that_is_down_is_503_and_health_says_so(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"  # below the ephemeral range (ports.py)
    task, port = await start_gateway(GatewayConfig(decoder_address=dead, port=0))
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/health") as health:
                assert health.status == 503
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with session.post(url, json=CHAT, timeout=aiohttp.ClientTimeout(total=30)) as response:
                assert response.status == 503
                assert (await response.json())["error"]["type"] == "service_unavailable"
    finally:
        await stop_gateway(task)
    await asyncio.sleep(0)


async def test_hostile_bodies_are_400_and_a_neighbour_keeps_streaming(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    decoder = await serve(tiny_model_dir, tiny_fp32)
    config = GatewayConfig(decoder_address=decoder.server.address, port=0, max_message_bytes=4 * 1024 * 1024)
    task, port = await start_gateway(config)
    url = f"http://127.0.0.1:{port}/v1/completions"
    hostile = {
        "deep nesting": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "not UTF-8": b'{"prompt": "\\xff\\xfe"}'.replace(b"\\xff\\xfe", bytes([0xFF, 0xFE])),
        "a list": b"[1, 2, 3]",
        "bad base64 rows": (
            b'{"model": "", "prompt": [{"type": "tandem_embeddings", "embeddings": '
            b'{"dtype": "float32", "shape": [1, 64], "data": "%%%"}}]}'
        ),
        "a lone surrogate": b'{"model": "", "prompt": "x\\ud800"}',
        "rows of the wrong width": (
            b'{"model": "", "prompt": [{"type": "tandem_embeddings", "embeddings": '
            b'{"dtype": "float32", "shape": [1, 3], "data": "AAAAAAAAAAAAAAAA"}}]}'
        ),
        "a prompt too long for the context": b'{"model": "", "prompt": "' + b"word " * 200_000 + b'"}',
    }
    try:
        async with aiohttp.ClientSession() as session:
            neighbour = asyncio.ensure_future(
                session.post(url, json={"model": "", "prompt": "hi", "max_tokens": 64, "ignore_eos": True})
            )
            for name, body in hostile.items():
                headers = {"Content-Type": "application/json"}
                async with session.post(url, data=body, headers=headers) as response:
                    assert response.status == 400, (name, response.status, await response.text())
                    assert (await response.json())["error"]["type"] == "invalid_request_error", name
            huge = b'{"model": "", "prompt": "' + b"word " * 6_000_000 + b'"}'  # 30 MB, over 4 MiB messages
            async with session.post(url, data=huge, headers={"Content-Type": "application/json"}) as response:
                error = (await response.json())["error"]
                assert response.status == 413 and "max_message_bytes" in error["message"]
                assert error["param"] == "prompt"
            reply = await neighbour
            assert reply.status == 200 and (await reply.json())["usage"]["completion_tokens"] == 64
    finally:
        await stop_gateway(task)
        await shutdown(decoder)


async def test_each_http_caller_is_its_own_caller_to_the_decoder(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """One address holding the decoder's whole per-connection bound leaves another address served: the
    gateway reaches the decoder over a connection per caller (it used to be one for all, so the second
    caller got 429 at once)."""
    from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
    from tandem.common.server import Service, start_server
    from tandem.decoder.api.servicer import DecoderServicer

    decoder = await serve(tiny_model_dir, tiny_fp32)
    servicer = DecoderServicer(
        tiny_model_dir.name, 64 * 1024 * 1024, engine=decoder.engine, max_streams_per_connection=2
    )
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    await server.set_serving()
    task, port = await start_gateway(
        GatewayConfig(decoder_address=server.address, port=0, max_streams_per_caller=8)
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    long = CHAT | {"max_tokens": 2000, "stream": True, "ignore_eos": True}
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as first,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))) as second,
        ):
            held = [await first.post(url, json=long) for _ in range(2)]
            for response in held:
                assert response.status == 200
                await response.content.readline()  # accepted and streaming
            over = await first.post(url, json=CHAT)
            assert over.status == 429  # the decoder's bound on this caller's connection
            assert "--max-streams-per-connection" in (await over.json())["error"]["message"]
            async with second.post(url, json=CHAT) as other:
                assert other.status == 200, await other.text()
            for response in held:
                response.close()
    finally:
        await stop_gateway(task)
        await server.stop(0)
        await shutdown(decoder)
