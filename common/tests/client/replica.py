"""A replica for client tests: a decoder and an encoder in one server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, start_server


class Replica(decoder_pb2_grpc.DecoderServicer, encoder_pb2_grpc.EncoderServicer):
    """A decoder and an encoder in one server, naming itself in every answer's `request_id`; while
    `is_loading`, Generate answers UNAVAILABLE before taking the call, as a loading decoder does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_loading = False
        self.num_refused = 0

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        if self.is_loading:
            self.num_refused += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decoder is loading; retry later")
        yield decoder_pb2.GenerateResponse(request_id=self.name, accepted=decoder_pb2.PromptAccepted())

    async def Embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EmbedResponse:
        return encoder_pb2.EmbedResponse(request_id=self.name)


class Refusing(Replica):
    """Refuses every Generate as invalid: not retried, so the call fails at once."""

    async def Generate(self, request, context):  # type: ignore[override]
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
        yield decoder_pb2.GenerateResponse()


async def serve_decoder(replica: Replica) -> RunningServer:
    """`replica` as a SERVING decoder on a free loopback port; the caller stops it."""
    service = Service("tandem.v1.Decoder", replica, decoder_pb2_grpc.add_DecoderServicer_to_server)
    running = await start_server(ServerOptions(port=0), [service])
    await running.set_serving()
    return running
