"""Untrusted images at a live encoder: each bad one is INVALID_ARGUMENT naming `image.data` (or
`image`) and its limit, its batch neighbours are answered, and the encoder keeps serving."""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from PIL import Image, ImageFile

from tandem.client.client import EncoderClient
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common.torch_part import tensors
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tests.integration.encoder.conftest import Encoder, start_encoder, stop_encoder
from tests.integration.vision.conftest import MAX_MESSAGE_BYTES, encoder_config

MAX_IMAGE_BYTES = 64 * 1024
MAX_IMAGE_PIXELS = 512 * 512


def _png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def _encoded(image_format: str, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.effect_noise(size, 64).convert("RGB").save(out, image_format)
    return out.getvalue()


@pytest.fixture
async def encoder(llava_dir: Path, llava_images: VisionLanguageEmbedder) -> AsyncIterator[Encoder]:
    config = encoder_config(llava_dir, max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_IMAGE_PIXELS)
    running = await start_encoder(config, llava_images)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        await stop_encoder(running)


BAD_IMAGES = {
    "a BMP": (_encoded("BMP", (40, 40)), "not a PNG, JPEG, WebP or GIF"),
    "random bytes": (bytes(range(256)) * 4, "not a PNG, JPEG, WebP or GIF"),
    "a truncated PNG": (_encoded("PNG", (300, 300))[:2000], "cannot be decoded as PNG"),
    "a 100,000 x 100,000 header in 100 bytes": (
        _png_claiming(100_000, 100_000),
        "claims 10000000000 pixels, over max_image_pixels",
    ),
    "1,000 x 1,000 pixels": (
        _png_claiming(1000, 1000),
        "claims 1000000 pixels, over max_image_pixels 262144",
    ),
    "a 100 KB file": (_encoded("PNG", (220, 220)), f"bytes exceed max_image_bytes {MAX_IMAGE_BYTES}"),
    "an empty image": (b"", "is empty"),
}


@pytest.mark.parametrize("name", BAD_IMAGES)
async def test_a_bad_image_is_invalid_argument_naming_the_field_and_the_encoder_keeps_serving(
    encoder: Encoder, name: str
) -> None:
    data, message = BAD_IMAGES[name]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await encoder.stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=data)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert error.value.details().startswith("image.data: ") and message in error.value.details()
    good = await encoder.stub.Embed(
        encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=_encoded("PNG", (50, 40))))
    )
    assert list(good.embeddings.shape) == [36, 64]


async def test_a_1_by_33_million_png_is_refused_for_its_resize_from_its_header_without_decoding(
    llava_dir: Path, llava_images: VisionLanguageEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Within the default 32 Mi pixel bound, it cost 1.05 s and 640 MB to decode before the
    # shortest-edge resize it implies (36 x 1,188,000,000) was refused; 8 at once took 3.7 GB.
    decoded = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image.size) or load(image))
    config = encoder_config(llava_dir, max_image_bytes=MAX_IMAGE_BYTES)
    assert 33_000_000 <= config.max_image_pixels
    running = await start_encoder(config, llava_images)  # type: ignore[arg-type]
    try:
        thin = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=_png_claiming(1, 60_000)))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await running.stub.Embed(thin)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("image.data: 1 x 60000 would be resized to 36 x 2160000")
        thinner = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=_png_claiming(1, 33_000_000)))
        with pytest.raises(grpc.aio.AioRpcError) as error:  # a side PIL's resize could not bear
            await running.stub.Embed(thinner)
        assert error.value.details().startswith("image.data: 1 x 33000000: a side over 65535 pixels")
        assert decoded == []
        good = await running.stub.Embed(
            encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=_encoded("PNG", (50, 40))))
        )
        assert list(good.embeddings.shape) == [36, 64] and set(decoded) == {(50, 40)}  # decoded, once taken
    finally:
        await stop_encoder(running)


async def test_a_request_far_over_the_image_bound_is_refused_from_its_size_unparsed(encoder: Encoder) -> None:
    bound = encoder.servicer.max_embed_request_bytes()
    assert bound is not None
    huge = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"\x89PNG" + bytes(bound)))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await encoder.stub.Embed(huge)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details()
    assert details.startswith("image.data:") and "max_image_bytes 65536" in details, details


async def test_bad_images_in_a_batch_fail_alone_and_the_good_ones_are_answered(
    encoder: Encoder, pictures: dict[str, Path]
) -> None:
    good = [p.read_bytes() for p in pictures.values()]

    def embed(data: bytes):
        return encoder.stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=data)))

    alone = [tensors.decode((await embed(data)).embeddings, "e") for data in good]  # the reference
    calls = [
        embed(d)
        for d in [good[0], BAD_IMAGES["a BMP"][0], good[1], BAD_IMAGES["a truncated PNG"][0], good[2]]
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert [isinstance(r, grpc.aio.AioRpcError) for r in results] == [False, True, False, True, False]
    assert all(
        r.code() == grpc.StatusCode.INVALID_ARGUMENT for r in results if isinstance(r, grpc.aio.AioRpcError)
    )
    for reply, expected in zip([results[0], results[2], results[4]], alone, strict=True):
        torch.testing.assert_close(tensors.decode(reply.embeddings, "e"), expected, atol=1e-6, rtol=0)
    assert max(encoder.servicer._batcher.batch_sizes) > 1  # type: ignore[union-attr]


async def test_concurrent_images_batch_and_each_gets_its_own_rows(
    encoder: Encoder, pictures: dict[str, Path]
) -> None:
    client = EncoderClient(encoder.server.address, MAX_MESSAGE_BYTES)
    try:
        data = [p.read_bytes() for p in pictures.values()] * 3
        alone = [tensors.decode((await client.embed(image=d)).embeddings, "e") for d in data[:3]]
        batched = await asyncio.gather(*(client.embed(image=d) for d in data))
        for i, reply in enumerate(batched):
            torch.testing.assert_close(tensors.decode(reply.embeddings, "e"), alone[i % 3], atol=1e-6, rtol=0)
        sizes = encoder.servicer._batcher.batch_sizes  # type: ignore[union-attr]
        assert max(sizes) > 1 and sum(sizes) == len(data) + 3
    finally:
        await client.close()


async def test_a_text_embed_is_answered_while_a_batch_of_images_holds_the_tower(
    encoder: Encoder, pictures: dict[str, Path]
) -> None:
    # Text waited 4.3-8.8 s behind batches of large images. The image worker is held here (a gate on
    # its thread, as a long batch would hold it), so the order is certain: text first, images after.
    gate = threading.Event()
    held = asyncio.ensure_future(encoder.servicer.on_worker(gate.wait))
    try:
        images = [
            asyncio.ensure_future(
                encoder.stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=p.read_bytes())))
            )
            for p in [*pictures.values()] * 3
        ]
        text = await encoder.stub.Embed(encoder_pb2.EmbedRequest(text="a neighbour"), timeout=60)
        ids = await encoder.stub.Tokenize(
            encoder_pb2.EncoderTokenizeRequest(texts=["a neighbour"]), timeout=60
        )
        assert list(text.token_ids.ids) == list(ids.tokens[0].ids)
        assert not any(image.done() for image in images)  # all still behind the held worker
    finally:
        gate.set()
        await held
    assert all(reply.placeholder == "<image>" for reply in await asyncio.gather(*images))


async def test_text_on_the_vision_language_encoder_is_the_language_models_own_rows(
    encoder: Encoder, llava_dir: Path
) -> None:
    from safetensors import safe_open

    reply = await encoder.stub.Embed(encoder_pb2.EmbedRequest(token_ids={"ids": [5, 6, 7]}))
    with safe_open(llava_dir / "model.safetensors", framework="pt") as weights:
        (name,) = [
            key
            for key in weights.keys()
            if key.endswith("language_model.embed_tokens.weight")
            or key.endswith("language_model.model.embed_tokens.weight")
        ]
        table = weights.get_tensor(name)
    assert torch.equal(tensors.decode(reply.embeddings, "e"), table[[5, 6, 7]])
    assert reply.placeholder == ""
