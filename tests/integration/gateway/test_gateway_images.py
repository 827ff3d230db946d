"""A chat's picture with `n` choices through the gateway, in front of a real decoder that fetches its
pictures' rows from a real encoder (tiny LLaVA, float32, both on loopback): the picture is encoded
once for the request, not once per choice, and each sampled choice j is the answer the same body
gives with n = 1 and seed + j."""

from __future__ import annotations

import base64
from pathlib import Path

import openai
import pytest
import torch

from services.encoder.tests.vision_checkpoints import make_image, make_llava
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.models.loader import load_model
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tandem.gateway.config import GatewayConfig
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.encoder.conftest import start_encoder, stop_encoder
from tests.integration.gateway.conftest import free_port, start_gateway, stop_gateway
from tests.integration.vision.conftest import MAX_MESSAGE_BYTES, encoder_config


async def test_n_sampled_choices_of_a_picture_encode_it_once_and_each_is_its_seeds_answer(
    tmp_path: Path,
) -> None:
    llava_dir = make_llava(tmp_path / "tiny-llava", tower="clip")
    picture = make_image(tmp_path / "picture.png", (53, 41), seed=1).read_bytes()
    encoder = await start_encoder(
        encoder_config(llava_dir), VisionLanguageEmbedder.load(llava_dir, torch.float32)
    )
    parts = EncoderParts(encoder.server.address, torch.float32, MAX_MESSAGE_BYTES, cache_bytes=1 << 20)
    decoder = await serve(
        llava_dir,
        load_model(llava_dir, dtype="float32"),
        encoder_parts=parts,
        num_kv_blocks=512,
        block_size=16,
    )
    nowhere = f"127.0.0.1:{free_port()}"  # the decoder fetches the rows: the gateway's encoder is not used
    task, port = await start_gateway(
        GatewayConfig(decoder_address=decoder.server.address, encoder_address=nowhere, port=0)
    )
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    body = {"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    sampling = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as client:
            together = await client.chat.completions.create(**body, **sampling, n=3, seed=11)  # type: ignore[call-overload]
            assert encoder.servicer.num_embeds == 1  # one fetch, which the choices sent with it shared
            alone = [
                await client.chat.completions.create(**body, **sampling, seed=11 + j)  # type: ignore[call-overload]
                for j in range(3)
            ]
    finally:
        await stop_gateway(task)
        await shutdown(decoder)
        await parts.close()
        await stop_encoder(encoder)
    texts = [choice.message.content for choice in together.choices]
    assert texts == [answer.choices[0].message.content for answer in alone]
    assert len(set(texts)) > 1  # sampled: the seeds made different answers
    assert together.usage is not None and together.usage.prompt_tokens > 36  # the picture's rows were in it


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' own, building the model
