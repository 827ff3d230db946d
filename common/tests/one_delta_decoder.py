"""A stand-in decoder for the commands' tests: each Generate is accepted, streams one delta ("hi") and
finishes at its length."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc


class OneDeltaDecoder(decoder_pb2_grpc.DecoderServicer):
    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        yield decoder_pb2.GenerateResponse(accepted=decoder_pb2.PromptAccepted())
        yield decoder_pb2.GenerateResponse(delta=decoder_pb2.TokenDelta(text="hi"))
        finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_LENGTH)
        yield decoder_pb2.GenerateResponse(finished=finished)
