"""`tandem embed --out FILE`: a FILE it cannot write is one line naming --out, exit 2."""

from __future__ import annotations

import click
import grpc
import pytest
import torch

from tandem import embed_cli
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc, tensor_pb2
from tandem.common.server import ServerOptions, Service, start_server
from tandem.common.torch_part import tensors


class _Encoder(encoder_pb2_grpc.EncoderServicer):
    """Two rows of 4 for any text."""

    async def Embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EmbedResponse:
        return encoder_pb2.EmbedResponse(
            embeddings=tensors.encode(torch.ones(2, 4)), token_ids=tensor_pb2.TokenIds(ids=[1, 2])
        )


async def test_an_out_file_it_cannot_write_names_the_flag(tmp_path) -> None:
    """It ended in a FileNotFoundError traceback, exit 1."""
    service = Service("tandem.v1.Encoder", _Encoder(), encoder_pb2_grpc.add_EncoderServicer_to_server)
    server = await start_server(ServerOptions(port=0), [service])
    await server.set_serving()
    out = tmp_path / "no-such-folder" / "rows.npy"
    try:
        with embed_cli.command().make_context(
            "embed", ["--address", server.address, "--text", "hi", "--out", str(out)]
        ) as ctx:
            with pytest.raises(click.BadParameter, match="No such file or directory") as caught:
                await embed_cli._embed(dict(ctx.params))
    finally:
        await server.stop(0)
    assert caught.value.param_hint == "'--out'"


def test_an_out_file_named_as_a_folder_is_refused(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out x.npy/` wrote the file x.npy: Path() drops the slash that said "a folder"."""
    from common.tests.ports import free_port
    from tandem import cli

    out = f"{tmp_path}/rows.npy/"
    assert cli.main(["embed", "--address", f"127.0.0.1:{free_port()}", "--text", "hi", "--out", out]) == 2
    assert capsys.readouterr().err == (
        f"tandem embed: --out (TANDEM_EMBED_OUT): {out} ends in '/', a folder's name: name the file\n"
    )
    assert not (tmp_path / "rows.npy").exists()
