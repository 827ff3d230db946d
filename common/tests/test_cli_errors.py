"""A client command's failed call names the flag to change, exit 2: an address serving the other service,
an adapter the decoder has not loaded. An answer standard output cannot take is one line, exit 1."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from common.tests.one_delta_decoder import OneDeltaDecoder
from common.tests.ports import free_port
from tandem import embed_cli, generate_cli
from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tandem.client.status import end_with
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.common.torch_part import tensors


class _Encoder(encoder_pb2_grpc.EncoderServicer):
    async def Embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EmbedResponse:
        return encoder_pb2.EmbedResponse(embeddings=tensors.encode(torch.ones(1, 4)))


class _DecoderWithoutLora(decoder_pb2_grpc.DecoderServicer):
    """Refuses any adapter as the decoder does (adapter_slots.py): NOT_FOUND, naming no field."""

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"adapter '{request.adapter}' is not loaded: this server runs without LoRA",
        )
        yield decoder_pb2.GenerateResponse()


async def _serving(service: Service) -> RunningServer:
    server = await start_server(ServerOptions(port=0), [service])
    await server.set_serving()
    return server


ENCODER = Service("tandem.v1.Encoder", _Encoder(), encoder_pb2_grpc.add_EncoderServicer_to_server)
GENERATE = "TANDEM_GENERATE"  # as `tandem generate` runs it: its flags' variables named in its errors
DECODER = Service("tandem.v1.Decoder", _DecoderWithoutLora(), decoder_pb2_grpc.add_DecoderServicer_to_server)


async def _generate(argv: list[str]) -> int:
    """`tandem generate argv`'s exit code, its flags' variables named as the command names them."""
    with generate_cli.command().make_context("generate", argv, auto_envvar_prefix=GENERATE) as ctx:
        return await generate_cli._generate(dict(ctx.params))


async def test_generate_at_the_encoders_address_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "UNIMPLEMENTED: Method not found!", exit 1, naming no address."""
    server = await _serving(ENCODER)
    try:
        argv = ["--address", server.address, "--prompt", "hi"]
        assert await _generate(argv) == 2
    finally:
        await server.stop(0)
    assert capsys.readouterr().err == (
        f"tandem generate: --address (TANDEM_GENERATE_ADDRESS) {server.address} does not serve "
        "tandem.v1.Decoder (is it the encoder?): UNIMPLEMENTED: Method not found!\n"
    )


async def test_an_embed_part_at_the_decoders_address_names_the_encoder_address(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With both addresses the decoder's, the bare line left the user to guess which one was wrong."""
    server = await _serving(DECODER)
    argv = ["--address", server.address, "--encoder-address", server.address, "--part", "embed:hi"]
    try:
        assert await _generate(argv) == 2
    finally:
        await server.stop(0)
    err = capsys.readouterr().err
    assert err.startswith(
        f"tandem generate: --encoder-address (TANDEM_GENERATE_ENCODER_ADDRESS) {server.address} "
        "does not serve tandem.v1.Encoder (is it the decoder?): "
    )


async def test_embed_at_the_decoders_address_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    server = await _serving(DECODER)
    try:
        with embed_cli.command().make_context("embed", ["--address", server.address, "--text", "hi"]) as ctx:
            assert await embed_cli._embed(dict(ctx.params)) == 2
    finally:
        await server.stop(0)
    assert "does not serve tandem.v1.Encoder (is it the decoder?)" in capsys.readouterr().err


async def test_an_adapter_not_loaded_names_the_adapter_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """It was "NOT_FOUND: adapter 'nope' is not loaded: ...", exit 1, as if the server had failed."""
    server = await _serving(DECODER)
    argv = ["--address", server.address, "--prompt", "hi", "--adapter", "nope"]
    try:
        assert await _generate(argv) == 2
    finally:
        await server.stop(0)
    assert capsys.readouterr().err == (
        "tandem generate: --adapter (TANDEM_GENERATE_ADAPTER): adapter 'nope' is not loaded: this server "
        "runs without LoRA\n"
    )


async def _tandem(*argv: str, redirect: str) -> tuple[int, str]:
    """`tandem ARGV` in a shell with `redirect` applied (`>&-`, `>/dev/full`, `<&-`): exit code, stderr."""
    script, tandem = f'exec "$@" {redirect}', "from tandem import cli; raise SystemExit(cli.main())"
    process = await asyncio.create_subprocess_exec(
        "sh", "-c", script, "sh", sys.executable, "-c", tandem, *argv, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode or 0, err.decode()


@pytest.mark.parametrize(
    ("redirect", "said"),
    [
        (">/dev/full", "cannot write the answer to standard output: No space left on device"),
        (">&-", "standard output is closed: nowhere to write the answer"),
    ],
)
async def test_an_answer_standard_output_cannot_take_is_one_line_and_exit_1(redirect: str, said: str) -> None:
    """/dev/full was an OSError traceback; a closed stdout exited 0 with the answer lost."""
    if "/dev/full" in redirect and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    service = Service("tandem.v1.Decoder", OneDeltaDecoder(), decoder_pb2_grpc.add_DecoderServicer_to_server)
    server = await _serving(service)
    try:
        code, err = await _tandem(
            "generate", "--address", server.address, "--prompt", "hi", redirect=redirect
        )
    finally:
        await server.stop(0)
    assert (code, err) == (1, f"tandem generate: {said}\n")


async def test_chat_with_stdin_closed_ends_at_once() -> None:
    """`tandem chat <&-` was an AttributeError traceback ('NoneType' has no 'isatty'): now no turn, exit 0."""
    code, err = await _tandem("chat", "--address", f"127.0.0.1:{free_port()}", redirect="<&-")
    assert (code, err) == (0, "")


class _EmptyTextRefused(decoder_pb2_grpc.DecoderServicer):
    """Refuses the prompt's first text as the decoder refuses an empty one (prompt_parts.py)."""

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        end_with(context, InvalidArgument("prompt[0].text", "must not be empty"))
        return
        yield


async def test_an_empty_prompt_names_its_variable_too(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "--prompt: must not be empty", the one flag line without its variable."""
    service = Service(
        "tandem.v1.Decoder", _EmptyTextRefused(), decoder_pb2_grpc.add_DecoderServicer_to_server
    )
    server = await _serving(service)
    argv = ["--address", server.address, "--prompt", ""]
    try:
        assert await _generate(argv) == 2
    finally:
        await server.stop(0)
    assert capsys.readouterr().err == (
        "tandem generate: --prompt (TANDEM_GENERATE_PROMPT): must not be empty "
        "(the request's prompt[0].text)\n"
    )
