"""A picture over what its Embed call may carry is a 413 naming the body's part (a chat's
`messages[i].content[j].image_url`, an embeddings body's `input[i].data`) and the flag that bounds it:
the encoder's max_image_bytes, the services' --max-message-bytes the gateway was told, or, where the
encoder's own cap is lower than that, gRPC's refusal named the same way. The encoder is the tests'
fake; no picture over a bound the gateway knows reaches it. An encoder that says a higher
max_image_bytes since (restarted with a higher --max-image-bytes) is asked again before a picture over
the bound it said before is refused."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_status import rpc_status

from tandem.client import error_reasons as reasons
from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.client.status import to_status_proto
from tandem.gateway.encoder_info import EncoderInfo
from tandem.gateway.image_bytes import over_cap

from .fake_decoder import fake_decoder
from .fake_encoder import fake_encoder
from .live_gateway import live_gateway

BOUND = 64 * 1024
PICTURE = b"\x89PNG" + b"\0" * (BOUND + 1)  # over BOUND alone, as a file


def _chat(picture: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]}


def _embeddings(picture: bytes) -> dict[str, Any]:
    image = {"type": "tandem_image", "data": base64.b64encode(picture).decode()}
    return {"input": ["a", image], "tandem_pooling": "none", "encoding_format": "base64"}


async def _refusal(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, json.loads(await response.text())["error"]


BODIES = [
    ("chat/completions", _chat, "messages[0].content[1].image_url"),
    ("embeddings", _embeddings, "input[1].data"),
]


@pytest.mark.parametrize(("path", "body", "part"), BODIES, ids=["chat", "embeddings"])
async def test_a_picture_over_the_encoders_max_image_bytes_is_413_naming_its_part(
    path: str, body: Any, part: str
) -> None:
    async with (
        fake_encoder(max_image_bytes=BOUND) as (encoder, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
    ):
        status, error = await _refusal(f"{url}/{path}", body(PICTURE))
    assert (status, error["param"]) == (413, part)
    assert error["message"] == (
        f"{part}: the picture is {len(PICTURE)} bytes, over the encoder's max_image_bytes {BOUND} "
        "(its --max-image-bytes, or what its --max-message-bytes carries)"
    )
    assert encoder.embedded == []


@pytest.mark.parametrize(("path", "body", "part"), BODIES, ids=["chat", "embeddings"])
async def test_an_encoder_restarted_with_a_higher_max_image_bytes_takes_the_pictures_under_it(
    path: str, body: Any, part: str
) -> None:
    # The gateway asked once for its life: the picture stayed 413, over the 64 KiB said before.
    async with (
        fake_encoder(max_image_bytes=BOUND) as (encoder, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
        aiohttp.ClientSession() as session,
    ):
        status, _ = await _refusal(f"{url}/{path}", body(PICTURE))
        assert (status, encoder.embedded) == (413, [])
        encoder.max_image_bytes = 4 * BOUND
        async with session.post(f"{url}/{path}", json=body(PICTURE)) as response:
            assert response.status == 200
        assert PICTURE in encoder.embedded
        num_model_infos = encoder.num_model_infos
        async with session.post(f"{url}/{path}", json=body(PICTURE)) as response:
            assert response.status == 200  # under the bound now held: not asked again
        assert encoder.num_model_infos == num_model_infos


@pytest.mark.parametrize(("path", "body", "part"), BODIES, ids=["chat", "embeddings"])
async def test_an_encoder_restarted_with_a_lower_max_image_bytes_is_413_naming_the_part_and_held(
    path: str, body: Any, part: str
) -> None:
    # The encoder's own refusal (INVALID_ARGUMENT) was a 400 naming no part (embeddings: param None).
    async with (
        fake_encoder(max_image_bytes=4 * BOUND) as (encoder, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(f"{url}/{path}", json=body(PICTURE)) as response:
            assert response.status == 200  # the gateway holds 4 * BOUND
        encoder.max_image_bytes = BOUND // 2
        status, error = await _refusal(f"{url}/{path}", body(PICTURE))
        assert (status, error["param"]) == (413, part)
        assert error["message"] == (
            f"{part}: the picture is {len(PICTURE)} bytes, over the encoder's max_image_bytes {BOUND // 2} "
            "(its --max-image-bytes, or what its --max-message-bytes carries)"
        )
        num_embedded = len(encoder.embedded)
        status, _ = await _refusal(f"{url}/{path}", body(PICTURE))
    assert (status, len(encoder.embedded)) == (413, num_embedded)  # the lower bound held: refused before


async def test_pictures_refused_at_once_share_one_call_asking_the_encoder_again() -> None:
    async with (
        fake_encoder(max_image_bytes=BOUND) as (encoder, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
    ):
        status, _ = await _refusal(f"{url}/embeddings", _embeddings(PICTURE))  # the info asked, held
        num_model_infos, encoder.model_info_s = encoder.num_model_infos, 0.5
        refusals = await asyncio.gather(
            *(_refusal(f"{url}/embeddings", _embeddings(PICTURE)) for _ in range(8))
        )
    assert [status for status, _ in refusals] == [413] * 8  # the bound still holds
    assert encoder.num_model_infos - num_model_infos == 1
    assert encoder.embedded == []


@pytest.mark.parametrize(("path", "body", "part"), BODIES, ids=["chat", "embeddings"])
async def test_a_picture_over_the_services_max_message_bytes_is_413_naming_its_part_and_the_flag(
    path: str, body: Any, part: str
) -> None:
    # It was `413 "CLIENT: Sent message larger than max (...)"` with no param: gRPC's own words.
    async with (
        fake_encoder() as (encoder, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address, max_message_bytes=BOUND) as url,
    ):
        status, error = await _refusal(f"{url}/{path}", body(PICTURE))
    assert (status, error["param"]) == (413, part)
    assert error["message"].startswith(f"{part}: the picture is {len(PICTURE)} bytes, an Embed call of ")
    assert error["message"].endswith(f"over the services' max_message_bytes {BOUND} (--max-message-bytes)")
    assert encoder.embedded == []


@pytest.mark.parametrize(("path", "body", "part"), BODIES, ids=["chat", "embeddings"])
async def test_an_encoder_whose_cap_is_below_the_gateways_refusal_names_the_part_and_the_flag(
    path: str, body: Any, part: str
) -> None:
    async with (
        fake_encoder(max_message_bytes=BOUND) as (_, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
    ):
        status, error = await _refusal(f"{url}/{path}", body(PICTURE))
    assert (status, error["param"]) == (413, part)
    assert error["message"].startswith(f"{part}: its Embed call is ")
    assert error["message"].endswith(
        f"bytes, over the encoder's --max-message-bytes of {BOUND}: send a smaller picture, or start the "
        "encoder with a larger --max-message-bytes"
    )


RECEIVED = "Stream removed (CLIENT: Received message larger than max (17039 vs. 16384))"
SENT = "CLIENT: Sent message larger than max (17039 vs. 16384)"
REFUSED = "SERVER: Received message larger than max (17039 vs. 16384)"
REPLY = "the encoder's reply is 17039 bytes, over the gateway's --max-message-bytes of 16384"
TEXT = encoder_pb2.EmbedRequest(text="a")
POOLED = encoder_pb2.EmbedRequest(text="a", pooling=encoder_pb2.POOLING_MEAN)
IMAGE = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"png"))


@pytest.mark.parametrize(
    ("details", "request_", "where", "message"),
    [
        (
            RECEIVED,
            TEXT,
            "input",
            f"input: {REPLY}: send a shorter input, or pool its rows (tandem_pooling mean), or start the "
            "gateway with a larger --max-message-bytes",
        ),
        (RECEIVED, POOLED, "input", f"input: {REPLY}: start the gateway with a larger --max-message-bytes"),
        (
            RECEIVED,
            IMAGE,
            "input[1].data",
            f"input[1].data: {REPLY}: pool its rows (tandem_pooling mean), or start the gateway with a "
            "larger --max-message-bytes",
        ),
        (
            RECEIVED,
            IMAGE,
            "messages[0].content[1].image_url",
            f"messages[0].content[1].image_url: {REPLY}: start the gateway with a larger --max-message-bytes",
        ),
        (
            SENT,
            TEXT,
            "input",
            "input: its Embed call is 17039 bytes, over the gateway's --max-message-bytes of 16384: send a "
            "shorter input, or start the gateway with a larger --max-message-bytes",
        ),
        (
            REFUSED,
            TEXT,
            "input",
            "input: its Embed call is 17039 bytes, over the encoder's --max-message-bytes of 16384: send a "
            "shorter input, or start the encoder with a larger --max-message-bytes",
        ),
        (
            REFUSED,
            IMAGE,
            "messages[0].content[1].image_url",
            "messages[0].content[1].image_url: its Embed call is 17039 bytes, over the encoder's "
            "--max-message-bytes of 16384: send a smaller picture, or start the encoder with a larger "
            "--max-message-bytes",
        ),
    ],
    ids=[
        "reply-text",
        "reply-pooled",
        "reply-embeddings-picture",
        "reply-chat-picture",
        "request-gateways-cap",
        "request-encoders-cap",
        "request-chat-picture",
    ],
)
def test_an_embed_call_over_a_cap_names_whose_cap_and_only_what_would_shrink_that_message(
    details: str, request_: encoder_pb2.EmbedRequest, where: str, message: str
) -> None:
    # A reply over a cap asked for "fewer or shorter inputs", but each input is its own Embed call, so
    # fewer could not shrink the one that failed; pooling was offered to a chat's picture and to an input
    # already pooled, and a request over a cap named no way out.
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    refusal = over_cap(error, request_, where, EncoderInfo.__new__(EncoderInfo))
    assert refusal is not None
    assert (refusal.status, refusal.param, refusal.message) == (413, where, message)


class SaidStub:
    """An encoder's stub whose GetModelInfo says max_image_bytes 4 * BOUND (before its restart)."""

    async def GetModelInfo(self, *_: object, **__: object) -> encoder_pb2.EncoderGetModelInfoResponse:
        return encoder_pb2.EncoderGetModelInfoResponse(max_image_bytes=4 * BOUND)


@pytest.mark.parametrize(
    "details",
    [
        f"image.data: {len(PICTURE)} bytes exceed max_image_bytes {BOUND // 2}",
        f"image.data: the request is {len(PICTURE) + 7} bytes, its image over max_image_bytes {BOUND // 2}; "
        "it was not parsed",
    ],
    ids=["parsed", "unparsed"],
)
async def test_the_encoders_refusal_over_a_lower_max_image_bytes_is_413_and_held_in_either_wording(
    details: str,
) -> None:
    # The encoder refuses a picture over its request bound unparsed (request_size), in other words than
    # the parsed check's: that one was a 400 passed on, and the lower bound was not held.
    info = EncoderInfo(SaidStub())  # type: ignore[arg-type]
    await info.get()
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=PICTURE))
    refusal = over_cap(error, request, "input[1].data", info)
    assert refusal is not None
    assert (refusal.status, refusal.param, refusal.message) == (
        413,
        "input[1].data",
        f"input[1].data: the picture is {len(PICTURE)} bytes, over the encoder's max_image_bytes "
        f"{BOUND // 2} (its --max-image-bytes, or what its --max-message-bytes carries)",
    )
    assert (await info.get()).max_image_bytes == BOUND // 2


async def test_the_encoders_refusal_is_read_by_its_reason_whatever_its_wording() -> None:
    # The wording was the only sign of this refusal: reworded, it was a 400 passed on and the bound not held.
    info = EncoderInfo(SaidStub())  # type: ignore[arg-type]
    await info.get()
    numbers = {reasons.IMAGE_BYTES: len(PICTURE), reasons.MAX_IMAGE_BYTES: BOUND // 2}
    said = reasons.info_of(reasons.ENCODER, reasons.IMAGE_TOO_LARGE, numbers)
    status = rpc_status.to_status(
        to_status_proto(InvalidArgument("image.data", "too big a picture", info=said))
    )
    trailers = grpc.aio.Metadata(*status.trailing_metadata)
    error = grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailers, status.details)
    request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=PICTURE))
    refusal = over_cap(error, request, "input[1].data", info)
    assert refusal is not None and (refusal.status, refusal.param) == (413, "input[1].data")
    assert f"max_image_bytes {BOUND // 2}" in refusal.message
    assert (await info.get()).max_image_bytes == BOUND // 2
