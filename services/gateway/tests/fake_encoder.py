"""An encoder for the gateway's tests: the Encoder service over gRPC on a free loopback port, whose rows
for a picture are a digest of its file (so an answer can tell which picture it saw), and which keeps
every picture it was asked to embed, so a test can count the embeds, and the embeds its caller
cancelled.

An Embed takes EMBED_S, as a vision tower takes its time: calls asking for one picture at once overlap,
as they would on a real encoder, rather than each finding the previous one's rows already cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc, tensor_pb2

EMBED_S = 0.25
ROWS, HIDDEN_SIZE = 2, 4  # a picture's rows: [2, 4] float32, the 32 bytes of its digest


def rows_of(image: bytes) -> bytes:
    """The fake's rows for `image`, as raw bytes."""
    return hashlib.blake2b(image, digest_size=ROWS * HIDDEN_SIZE * 4).digest()


@dataclass
class FakeEncoder(encoder_pb2_grpc.EncoderServicer):
    embedded: list[bytes] = field(default_factory=list)  # the picture of every Embed call, in order
    num_cancelled: int = 0  # Embed calls the caller cancelled before they answered
    max_image_bytes: int = 0  # what its GetModelInfo says (0: no bound said); a test may change it
    num_model_infos: int = 0  # GetModelInfo calls answered
    model_info_s: float = 0.0  # how long a GetModelInfo takes
    token: str | None = None  # where set, a GetModelInfo with another bearer token is UNAUTHENTICATED
    model: str = "fake-encoder"  # the model its GetModelInfo names
    embedder: str = ""  # the embedder its GetModelInfo names ("lookup", "projector"; "": none said)
    embed_gate: asyncio.Event | None = None  # where set, each Embed answers once it is set

    async def GetModelInfo(
        self, request: encoder_pb2.EncoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderGetModelInfoResponse:
        await asyncio.sleep(self.model_info_s)
        if self.token is not None:
            if dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a token this encoder takes")
        self.num_model_infos += 1
        return encoder_pb2.EncoderGetModelInfoResponse(
            model=self.model,
            embedder=self.embedder,
            hidden_size=HIDDEN_SIZE,
            max_image_bytes=self.max_image_bytes,
        )

    async def Embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EmbedResponse:
        self.embedded.append(request.image.data)
        if 0 < self.max_image_bytes < (num_bytes := len(request.image.data)):  # as the real one words it
            message = f"image.data: {num_bytes} bytes exceed max_image_bytes {self.max_image_bytes}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            await asyncio.sleep(EMBED_S)
            if self.embed_gate is not None:
                await self.embed_gate.wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        rows = tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[ROWS, HIDDEN_SIZE], data=rows_of(request.image.data)
        )
        return encoder_pb2.EmbedResponse(embeddings=rows, placeholder="<image>")


@contextlib.asynccontextmanager
async def fake_encoder(
    max_image_bytes: int = 0, max_message_bytes: int | None = None, token: str | None = None
) -> AsyncIterator[tuple[FakeEncoder, str]]:
    """The fake serving on a free loopback port: itself and its address; stopped afterwards. Its
    GetModelInfo says `max_image_bytes` (its Embed refuses a larger picture, as the real one does), to
    callers with `token` where one is given; with `max_message_bytes`, gRPC refuses a larger request."""
    encoder = FakeEncoder(max_image_bytes=max_image_bytes, token=token)
    options = [] if max_message_bytes is None else [("grpc.max_receive_message_length", max_message_bytes)]
    server = grpc.aio.server(options=options)
    encoder_pb2_grpc.add_EncoderServicer_to_server(encoder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield encoder, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
