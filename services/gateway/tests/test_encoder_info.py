"""The encoder's model info, held by the gateway: asked once before anything is answered, then asked again
beside the requests when the encoder replicas change, the requests waiting on it only where their model
changed, and for a bounded time; every ask made with the gateway's one token, shared by every caller."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.gateway.encoder_info import Answering, EncoderInfo
from tandem.gateway.image_bytes import refusal_asking_again

from .fake_encoder import fake_encoder

TOKEN = (("authorization", "Bearer the gateway's"),)
PICTURE = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"x" * 2000))


class HeldStub:
    """An encoder's stub whose GetModelInfo answers `info` once `gate` is open (an encoder busy
    embedding), recording each ask's metadata."""

    def __init__(self) -> None:
        self.info = encoder_pb2.EncoderGetModelInfoResponse(model="enc-X", max_image_bytes=1000)
        self.gate = asyncio.Event()
        self.gate.set()
        self.asked: list[object] = []

    async def GetModelInfo(
        self, request: encoder_pb2.EncoderGetModelInfoRequest, metadata: object = None, timeout: float = 0
    ) -> encoder_pb2.EncoderGetModelInfoResponse:
        self.asked.append(metadata)
        await self.gate.wait()
        answer = encoder_pb2.EncoderGetModelInfoResponse()
        answer.CopyFrom(self.info)
        return answer


async def _held(answering: list[Answering]) -> tuple[HeldStub, EncoderInfo]:
    """An `EncoderInfo` over a `HeldStub`, its first ask answered (enc-X), the replicas `answering[0]`."""
    stub = HeldStub()
    info = EncoderInfo(stub, lambda: answering[0], TOKEN)  # type: ignore[arg-type]
    assert (await info.get()).model == "enc-X"
    return stub, info


async def _wait_for_asks(stub: HeldStub, count: int) -> None:
    async with asyncio.timeout(5):
        while len(stub.asked) < count:
            await asyncio.sleep(0.01)


async def test_a_change_of_the_replicas_called_is_asked_beside_the_requests_which_get_the_held_info() -> None:
    """A slow GetModelInfo (3 s) held 90 of 159 embeddings up to 2 s each, again and again, when the
    replicas called changed: they are answered the held info while one ask runs."""
    answering = [Answering("enc-X", ("a",))]
    stub, info = await _held(answering)
    stub.gate.clear()
    stub.info.max_image_bytes = 2000
    answering[0] = Answering("enc-X", ("a", "b"))
    answers = [await info.get() for _ in range(20)]  # each at once, the ask held
    await _wait_for_asks(stub, 2)
    assert {a.max_image_bytes for a in answers} == {1000} and len(stub.asked) == 2
    stub.gate.set()
    async with asyncio.timeout(5):
        while (await info.get()).max_image_bytes != 2000:
            await asyncio.sleep(0.01)
    assert len(stub.asked) == 2


async def test_a_change_of_the_replicas_model_holds_the_requests_on_the_ask_for_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The held info is the old model's name and bounds: requests wait on the ask of a new model, for
    REASK_TIMEOUT_S from the change at most, then are answered the held info while it runs on."""
    answering = [Answering("enc-X", ("a",))]
    stub, info = await _held(answering)
    stub.info.model = "enc-Y"
    answering[0] = Answering("enc-Y", ("a",))
    assert (await info.get()).model == "enc-Y"  # answered in time: the new model's

    monkeypatch.setattr("tandem.gateway.encoder_info.REASK_TIMEOUT_S", 0.05)
    stub.gate.clear()
    stub.info.model = "enc-Z"
    answering[0] = Answering("enc-Z", ("a",))
    assert (await info.get()).model == "enc-Y"  # waited its bound, the ask held
    assert [(await info.get()).model for _ in range(10)] == ["enc-Y"] * 10  # past the bound: at once
    assert len(stub.asked) == 3  # the one ask, still out
    stub.gate.set()
    async with asyncio.timeout(5):
        while (await info.get()).model != "enc-Z":
            await asyncio.sleep(0.01)


async def test_callers_with_50_tokens_share_one_ask_made_with_the_gateways_token() -> None:
    """Each caller's token made an ask of its own: 50 callers, 50 asks of one change."""
    answering = [Answering("enc-X", ("a",))]
    stub, info = await _held(answering)
    stub.gate.clear()
    answering[0] = Answering("enc-Y", ("a",))
    stub.info.model = "enc-Y"
    getting = [asyncio.ensure_future(info.get()) for _ in range(50)]
    await _wait_for_asks(stub, 2)
    stub.gate.set()
    assert {answer.model for answer in await asyncio.gather(*getting)} == {"enc-Y"}
    assert stub.asked == [TOKEN, TOKEN]


async def test_a_refusal_asks_again_with_the_gateways_token_and_takes_a_raised_bound() -> None:
    async with fake_encoder(max_image_bytes=1000, token="good") as (encoder, address):
        async with grpc.aio.insecure_channel(address) as channel:
            info = EncoderInfo(
                encoder_pb2_grpc.EncoderStub(channel), metadata=(("authorization", "Bearer good"),)
            )
            await info.get()
            encoder.max_image_bytes, encoder.model_info_s = 5000, 0.05  # restarted with a higher bound
            refusals = await asyncio.gather(
                *(refusal_asking_again(info, 1 << 24, PICTURE, "input[0].data") for _ in range(4))
            )
    assert refusals == [None] * 4  # the encoder's new bound: the picture goes on
    assert encoder.num_model_infos == 2  # the first ask, and one shared by the 4 refusals


class RotatedStub(HeldStub):
    """An encoder whose tokens were rotated past the gateway's check token (the least of its
    --auth-token-file): it refuses that one and takes the callers'."""

    async def GetModelInfo(
        self, request: encoder_pb2.EncoderGetModelInfoRequest, metadata: object = None, timeout: float = 0
    ) -> encoder_pb2.EncoderGetModelInfoResponse:
        if metadata == TOKEN:
            self.asked.append(metadata)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(), "not a token"
            )
        return await super().GetModelInfo(request, metadata, timeout)


async def test_an_ask_the_encoders_refuse_the_gateways_token_for_is_asked_again_with_the_callers() -> None:
    """Mid-rotation the encoders took the caller's token and refused the check's: asked with the check's
    alone, a good caller got 401 on every embedding and image chat. The caller's is tried next."""
    caller = (("authorization", "Bearer a caller's"),)
    stub = RotatedStub()
    info = EncoderInfo(stub, lambda: Answering("enc-X", ("a",)), TOKEN)  # type: ignore[arg-type]
    assert (await info.get(caller)).model == "enc-X"
    assert stub.asked == [TOKEN, caller]
    with pytest.raises(grpc.aio.AioRpcError):  # with no caller's token to try, the refusal stands
        await EncoderInfo(RotatedStub(), lambda: Answering("enc-X", ("a",)), TOKEN).get()  # type: ignore[arg-type]
