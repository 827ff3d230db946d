"""`tandem generate`: a stream that ends with its finished event exits 0, printed as text or JSON."""

from __future__ import annotations

import json

import pytest

from common.tests.one_delta_decoder import OneDeltaDecoder
from tandem import generate_cli
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
from tandem.common.server import ServerOptions, Service, start_server


@pytest.mark.parametrize("as_json", [False, True])
async def test_a_finished_stream_exits_0(as_json: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """With --json it exited 1 after every good stream: "the stream ended without its finished event"."""
    service = Service("tandem.v1.Decoder", OneDeltaDecoder(), decoder_pb2_grpc.add_DecoderServicer_to_server)
    server = await start_server(ServerOptions(port=0), [service])
    await server.set_serving()
    argv = ["--address", server.address, "--prompt", "hello", *(["--json"] if as_json else [])]
    try:
        with generate_cli.command().make_context("generate", argv) as ctx:
            assert await generate_cli._generate(dict(ctx.params)) == 0
    finally:
        await server.stop(0)
    out = capsys.readouterr().out
    if as_json:
        assert [next(iter(json.loads(line))) for line in out.splitlines()] == [
            "accepted",
            "delta",
            "finished",
        ]
    else:
        assert out.startswith("hi\n[FINISH_REASON_LENGTH; 0 tokens")
