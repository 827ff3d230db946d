"""The encoder's model info, held by the gateway: a call asking for it is shared only by callers with the
same token, since the encoder answers each as its token allows. A caller with a token the encoder refuses
asking at the same time as one with a token it takes leaves the latter's answer alone: on the first ask
(it was the bad token's UNAUTHENTICATED) and on the ask again of a refusal (it was the old bound's 413)."""

from __future__ import annotations

import asyncio

import grpc

from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.gateway.encoder_info import EncoderInfo
from tandem.gateway.image_bytes import refusal_asking_again

from .fake_encoder import fake_encoder

GOOD = (("authorization", "Bearer good"),)
BAD = (("authorization", "Bearer other"),)
PICTURE = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"x" * 2000))


async def test_a_first_ask_with_a_refused_token_does_not_answer_a_caller_with_a_good_one() -> None:
    async with fake_encoder(max_image_bytes=1000, token="good") as (encoder, address):
        encoder.model_info_s = 0.05
        async with grpc.aio.insecure_channel(address) as channel:
            info = EncoderInfo(encoder_pb2_grpc.EncoderStub(channel))
            bad, good = await asyncio.gather(info.get(BAD), info.get(GOOD), return_exceptions=True)
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(good, encoder_pb2.EncoderGetModelInfoResponse) and good.max_image_bytes == 1000


async def test_an_ask_again_with_a_refused_token_does_not_leave_a_good_caller_on_the_old_bound() -> None:
    async with fake_encoder(max_image_bytes=1000, token="good") as (encoder, address):
        async with grpc.aio.insecure_channel(address) as channel:
            info = EncoderInfo(encoder_pb2_grpc.EncoderStub(channel))
            await info.get(GOOD)
            encoder.max_image_bytes, encoder.model_info_s = 5000, 0.05  # restarted with a higher bound
            _, good = await asyncio.gather(
                refusal_asking_again(info, 1 << 24, PICTURE, "input[0].data", BAD),
                refusal_asking_again(info, 1 << 24, PICTURE, "input[0].data", GOOD),
            )
    assert good is None  # the encoder's new bound: the picture goes on


async def test_callers_with_one_token_still_share_one_call() -> None:
    async with fake_encoder(max_image_bytes=1000, token="good") as (encoder, address):
        encoder.model_info_s = 0.05
        async with grpc.aio.insecure_channel(address) as channel:
            info = EncoderInfo(encoder_pb2_grpc.EncoderStub(channel))
            await asyncio.gather(*(info.get(GOOD) for _ in range(4)))
    assert encoder.num_model_infos == 1
