"""A chat's picture sent as an `encoder` part: the decoder fetches its rows from the encoder itself (over
shared memory on one host, bytes otherwise), and answers what the client-carried rows give, while the
caller never holds the rows. Tiny LLaVA, float32, both services on loopback."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from common.tests.ports import free_port
from services.encoder.tests.vision_checkpoints import make_image
from tandem.client.client import EncoderPart
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tests.integration.decoder.conftest import Served, serve, shutdown
from tests.integration.encoder.conftest import Encoder, start_encoder, stop_encoder
from tests.integration.vision.conftest import MAX_MESSAGE_BYTES, Split, encoder_config

QUESTION = "What is in the picture?"
IMAGE_ROW_BYTES = 36 * 64 * 4  # tiny LLaVA: 36 rows of 64 float32 per picture


@dataclass
class Handoff:
    encoder: Encoder
    decoder: Served
    parts: EncoderParts


async def _handoff(llava_dir: Path, language: LoadedModel, images, **encoder_settings) -> Handoff:
    encoder = await start_encoder(encoder_config(llava_dir, **encoder_settings), images)
    parts = EncoderParts(encoder.server.address, torch.float32, MAX_MESSAGE_BYTES, cache_bytes=1 << 20)
    decoder = await serve(llava_dir, language, encoder_parts=parts, num_kv_blocks=512, block_size=16)
    return Handoff(encoder, decoder, parts)


async def _stop(handoff: Handoff) -> None:
    await shutdown(handoff.decoder)
    await handoff.parts.close()
    await stop_encoder(handoff.encoder)


@pytest.fixture
async def handoff(
    llava_dir: Path, llava_language_model: LoadedModel, llava_images: VisionLanguageEmbedder
) -> AsyncIterator[Handoff]:
    made = await _handoff(llava_dir, llava_language_model, llava_images)
    try:
        yield made
    finally:
        await _stop(made)


async def _chat(decoder: Served, content: list, num_tokens: int = 16) -> tuple[list[int], int, object]:
    """The greedy tokens, the bytes of every message the caller received, and the finished event."""
    call = decoder.client.chat(
        [{"role": "user", "content": content}], max_new_tokens=num_tokens, temperature=0, ignore_eos=True
    )
    tokens, received, finished = [], 0, None
    async for response in call:
        received += response.ByteSize()
        if response.HasField("delta"):
            tokens += list(response.delta.token_ids)
        elif response.HasField("finished"):
            finished = response.finished
    return tokens, received, finished


async def test_a_picture_as_an_encoder_part_answers_as_its_client_carried_rows_which_the_caller_never_holds(
    split: Split, handoff: Handoff, pictures: dict[str, Path]
) -> None:
    for name, picture in pictures.items():
        data = picture.read_bytes()
        carried, _, _ = await _chat(split.decoder, [await split.images.embed_image(data), QUESTION])
        fetched, received, finished = await _chat(handoff.decoder, [EncoderPart(image=data), QUESTION])
        assert fetched == carried, name
        assert finished.usage.input_tokens > 36  # the picture's 36 rows were in the prompt
        assert received < IMAGE_ROW_BYTES / 4, (name, received)  # tokens and events only, never rows
    assert (handoff.parts.num_shared, handoff.parts.num_bytes) == (len(pictures), 0)  # one host: /dev/shm
    assert handoff.encoder.servicer.segments.num_leased == 0  # each segment released by its reader


async def test_an_encoder_on_another_host_sends_the_rows_as_bytes(
    split: Split,
    llava_dir: Path,
    llava_language_model: LoadedModel,
    llava_images: VisionLanguageEmbedder,
    pictures: dict[str, Path],
    tmp_path: Path,
) -> None:
    """The encoder's /dev/shm is another directory: the decoder's proof file is not in it."""
    elsewhere = await _handoff(llava_dir, llava_language_model, llava_images, shared_memory_dir=tmp_path)
    try:
        data = pictures["portrait.jpg"].read_bytes()
        carried, _, _ = await _chat(split.decoder, [await split.images.embed_image(data), QUESTION])
        fetched, _, _ = await _chat(elsewhere.decoder, [EncoderPart(image=data), QUESTION])
        assert fetched == carried
        assert (elsewhere.parts.num_shared, elsewhere.parts.num_bytes) == (0, 1)
        assert not list(tmp_path.iterdir())
    finally:
        await _stop(elsewhere)


async def test_the_same_picture_twice_is_encoded_once(handoff: Handoff, pictures: dict[str, Path]) -> None:
    data = pictures["square.webp"].read_bytes()
    first, _, first_finished = await _chat(handoff.decoder, [EncoderPart(image=data), QUESTION])
    again, _, again_finished = await _chat(handoff.decoder, [EncoderPart(image=data), QUESTION])
    assert again == first
    assert handoff.encoder.servicer.num_embeds == 1  # the second request's rows came from the cache
    assert handoff.parts.cache.num_hits == 1
    assert again_finished.usage.cached_input_tokens >= 32  # and its KV from the prefix cache
    other, _, _ = await _chat(handoff.decoder, [EncoderPart(image=pictures["landscape.png"].read_bytes())])
    assert handoff.encoder.servicer.num_embeds == 2


async def test_an_encoder_part_of_text_is_placed_where_it_stands(
    handoff: Handoff, split: Split, pictures: dict[str, Path]
) -> None:
    """Text through the encoder is rows spliced in place, as an embeddings part of the same rows."""
    reply = await split.images.embed(text="a cat")
    carried, _, _ = await _chat(split.decoder, [reply.embeddings, QUESTION])
    fetched, _, _ = await _chat(handoff.decoder, [EncoderPart(text="a cat"), QUESTION])
    assert fetched == carried


async def test_a_picture_the_encoder_cannot_read_is_invalid_argument_naming_the_part(
    handoff: Handoff, tmp_path: Path
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _chat(handoff.decoder, [QUESTION, EncoderPart(image=b"not a picture")])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The encoder's field (its BadRequest's) under the part's, as the message names it.
    assert error.value.details().startswith(
        "chat.messages[0].content[1].encoder.image.data: the encoder refused it: "
    )
    picture = make_image(tmp_path / "fine.png")  # the decoder serves on
    tokens, _, _ = await _chat(handoff.decoder, [EncoderPart(image=picture.read_bytes())], num_tokens=2)
    assert len(tokens) == 2


async def test_a_decoder_without_an_encoder_refuses_an_encoder_part_naming_the_flag(
    split: Split, pictures: dict[str, Path]
) -> None:
    info = await split.decoder.client.model_info()
    assert not info.accepts_encoder_parts
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _chat(split.decoder, [EncoderPart(image=pictures["square.webp"].read_bytes())])
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.details() == (
        "chat.messages[0].content[0].encoder: this decoder has no encoder; start it with --encoder ADDR"
    )


async def test_model_info_says_a_decoder_with_an_encoder_accepts_encoder_parts(handoff: Handoff) -> None:
    assert (await handoff.decoder.client.model_info()).accepts_encoder_parts


async def test_the_gateways_image_url_goes_to_the_decoders_encoder_never_through_the_gateway(
    split: Split, handoff: Handoff, pictures: dict[str, Path]
) -> None:
    import base64

    import openai

    from tandem.gateway.config import GatewayConfig
    from tests.integration.gateway.conftest import start_gateway, stop_gateway

    nowhere = f"127.0.0.1:{free_port()}"  # the gateway's own encoder address leads nowhere: it is not used
    picture = pictures["landscape.png"]
    expected, _, _ = await _chat(
        split.decoder, [await split.images.embed_image(picture.read_bytes()), QUESTION]
    )
    task, port = await start_gateway(
        GatewayConfig(decoder_address=handoff.decoder.server.address, encoder_address=nowhere, port=0)
    )
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as client:
            reply = await client.chat.completions.create(
                model="", messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="", messages=[{"role": "user", "content": broken}])
            assert error.value.body["param"] == "messages[0].content[0].image_url"
    finally:
        await stop_gateway(task)
    text, _ = await split.decoder.client.chat_text(
        [{"role": "user", "content": [await split.images.embed_image(picture.read_bytes()), QUESTION]}],
        max_new_tokens=16,
        temperature=0,
        ignore_eos=True,
    )
    assert reply.choices[0].message.content == text and len(expected) == 16
    assert handoff.encoder.servicer.num_embeds == 1  # by the decoder's encoder (the broken one refused)


async def _tandem_chat(decoder: Served, picture: Path) -> tuple[int, str, str]:
    """`tandem chat --image picture` asking QUESTION once: its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.cli", "chat", "--address", decoder.server.address,
        "--encoder-address", "127.0.0.1:1",  # never used: the decoder fetches the rows itself
        "--image", str(picture), "--max-tokens", "12",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(f"{QUESTION}\n".encode()), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_tandem_chat_sends_an_image_to_a_decoder_with_an_encoder_as_an_encoder_part(
    split: Split, handoff: Handoff, pictures: dict[str, Path]
) -> None:
    picture = pictures["landscape.png"]
    image = await split.images.embed_image(picture.read_bytes())
    expected, _ = await split.decoder.client.chat_text(
        [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=12, temperature=0
    )
    code, out, err = await _tandem_chat(handoff.decoder, picture)
    assert code == 0, err
    assert out.splitlines()[0] == f"assistant> {expected}"
    assert handoff.encoder.servicer.num_embeds == 1


async def test_tandem_chat_names_the_image_file_the_decoders_encoder_refuses(
    handoff: Handoff, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a picture")
    code, _, err = await _tandem_chat(handoff.decoder, broken)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"tandem chat: --image {broken}: the encoder refused it: "), err
    assert err.endswith("(the request's chat.messages[0].content[0].encoder.image.data)\n"), err
