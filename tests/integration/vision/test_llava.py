"""A LLaVA checkpoint served split in two: images through the encoder, its rows through the decoder,
against transformers' whole model (float32, tiny random weights, so every comparison can fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from tandem.client.client import ImageRows
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.common.torch_part import tensors
from tests.integration.vision.conftest import Split

QUESTION = "What is in the picture?"


def _reference_features(reference: Any, picture: Path) -> torch.Tensor:
    model, processor = reference
    pixels = processor.image_processor(Image.open(picture), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        features = model.get_image_features(pixel_values=pixels)
    features = getattr(features, "pooler_output", features)
    first = features[0] if isinstance(features, list | tuple) else features
    return first.reshape(-1, first.shape[-1])


def _reference_greedy(reference: Any, picture: Path, question: str, num_tokens: int = 16) -> list[int]:
    model, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=Image.open(picture), text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


async def _chat_tokens(split: Split, content: list, num_tokens: int = 16) -> list[int]:
    call = split.decoder.client.chat(
        [{"role": "user", "content": content}], max_new_tokens=num_tokens, temperature=0, ignore_eos=True
    )
    return [t async for r in call if r.HasField("delta") for t in r.delta.token_ids]


async def test_the_encoders_rows_for_an_image_are_transformers_image_features(
    split: Split, reference: Any, pictures: dict[str, Path]
) -> None:
    for name, picture in pictures.items():
        reply = await split.images.embed(image=picture.read_bytes())
        rows = tensors.decode(reply.embeddings, "embeddings")
        expected = _reference_features(reference, picture)
        assert rows.shape == expected.shape == (36, 64), name
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0, msg=name)
        assert reply.placeholder == "<image>"
        assert list(reply.token_ids.ids) == [reference[0].config.image_token_index] * 36
        assert reply.usage.input_tokens == 36


async def test_a_chat_with_a_picture_gives_transformers_greedy_tokens(
    split: Split, reference: Any, pictures: dict[str, Path]
) -> None:
    for name, picture in pictures.items():
        image = await split.images.embed_image(picture.read_bytes())
        ours = await _chat_tokens(split, [image, QUESTION])
        assert ours == _reference_greedy(reference, picture, QUESTION), name
        assert len(set(ours)) > 3, ours  # the weights make a varied answer, not one token repeated


async def test_the_template_places_the_image_wherever_the_caller_put_it_in_the_message(
    split: Split, pictures: dict[str, Path]
) -> None:
    """llava-1.5's template writes images before the text; the part's order in the message is free."""
    image = await split.images.embed_image(pictures["landscape.png"].read_bytes())
    assert await _chat_tokens(split, [QUESTION, image]) == await _chat_tokens(split, [image, QUESTION])


async def test_different_pictures_give_different_answers(split: Split, pictures: dict[str, Path]) -> None:
    answers = set()
    for picture in pictures.values():
        image = await split.images.embed_image(picture.read_bytes())
        answers.add(tuple(await _chat_tokens(split, [image, QUESTION])))
    assert len(answers) == len(pictures)


async def test_an_image_repeated_is_a_prefix_cache_hit(split: Split, pictures: dict[str, Path]) -> None:
    image = await split.images.embed_image(pictures["square.webp"].read_bytes())
    cached = []
    for _ in range(2):
        _, finished = await split.decoder.client.chat_text(
            [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=2, temperature=0
        )
        cached.append(finished.usage.cached_input_tokens)
    assert cached[0] == 0
    assert cached[1] >= 32, cached  # "USER: " and the 36 image rows, in whole blocks of 16


async def test_a_token_only_neighbour_answers_the_same_beside_image_requests(
    split: Split, pictures: dict[str, Path]
) -> None:
    import asyncio

    alone = await _chat_tokens(split, [QUESTION], num_tokens=24)
    images = [await split.images.embed_image(p.read_bytes()) for p in pictures.values()]
    together = await asyncio.gather(
        _chat_tokens(split, [QUESTION], num_tokens=24), *(_chat_tokens(split, [i, QUESTION]) for i in images)
    )
    assert together[0] == alone


async def test_speculation_on_an_image_prompt_keeps_greedy_output(
    split: Split, pictures: dict[str, Path]
) -> None:
    image = await split.images.embed_image(pictures["portrait.jpg"].read_bytes())
    plain = await _chat_tokens(split, [image, QUESTION], num_tokens=24)
    call = split.decoder.client.chat(
        [{"role": "user", "content": [image, QUESTION]}],
        max_new_tokens=24,
        temperature=0,
        ignore_eos=True,
        speculative_tokens=4,
    )
    assert [t async for r in call if r.HasField("delta") for t in r.delta.token_ids] == plain


async def test_prompt_logprobs_mark_the_image_rows(split: Split, pictures: dict[str, Path]) -> None:
    image = await split.images.embed_image(pictures["portrait.jpg"].read_bytes())
    call = split.decoder.client.chat(
        [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=1, temperature=0, prompt_logprobs=0
    )
    entries = []
    async for response in call:
        if response.HasField("delta"):
            entries += list(response.delta.prompt_logprobs)
    without_id = [i for i, entry in enumerate(entries) if not entry.HasField("token_id")]
    start = without_id[0]
    assert without_id == list(range(start, start + 36))  # the 36 rows: no token, no logprob


async def test_the_decoder_refuses_an_image_the_template_does_not_place(
    split: Split, pictures: dict[str, Path]
) -> None:
    import grpc
    import pytest

    image = await split.images.embed_image(pictures["square.webp"].read_bytes())
    no_images = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await split.decoder.client.chat_text(
            [{"role": "user", "content": [image, QUESTION]}], chat_template=no_images, max_new_tokens=1
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.chat_template" in error.value.details() and "0 image placeholders" in error.value.details()


async def test_model_info_on_both_sides_names_the_placeholder(split: Split) -> None:
    encoder_info = await split.encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest())
    assert encoder_info.accepts_images and encoder_info.image_placeholder == "<image>"
    assert encoder_info.embedder == "vision" and encoder_info.hidden_size == 64
    decoder_info = await split.decoder.client.model_info()
    assert decoder_info.image_placeholder == "<image>"
    assert decoder_info.architecture == "LlamaForCausalLM"


def test_image_rows_are_a_chat_part_of_their_own() -> None:
    from tandem.client.client import chat_prompt

    rows = tensors.encode(torch.zeros(2, 4))
    prompt = chat_prompt([{"role": "user", "content": [ImageRows(rows), "hi"]}])
    assert [p.WhichOneof("part") for p in prompt.messages[0].content] == ["image", "text"]
    assert isinstance(prompt, decoder_pb2.ChatPrompt)


async def test_an_openai_image_url_part_through_the_gateway_answers_as_the_image_part_does(
    split: Split, pictures: dict[str, Path]
) -> None:
    import base64

    import openai

    from tandem.gateway.config import GatewayConfig
    from tests.integration.gateway.conftest import start_gateway, stop_gateway

    picture = pictures["landscape.png"]
    image = await split.images.embed_image(picture.read_bytes())
    expected = await _chat_tokens(split, [image, QUESTION], num_tokens=12)
    task, port = await start_gateway(
        GatewayConfig(
            decoder_address=split.decoder.server.address, encoder_address=split.encoder.server.address, port=0
        )
    )
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as client:
            reply = await client.chat.completions.create(
                model="", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0,
                logprobs=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            remote = [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="", messages=[{"role": "user", "content": remote}])
            assert (
                "fetches no URL" in str(error.value)
                and error.value.body["param"] == "messages[0].content[0].image_url"
            )
            broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="", messages=[{"role": "user", "content": broken}])
            assert error.value.body["param"] == "messages[0].content[0].image_url"
    finally:
        await stop_gateway(task)
    ids = [int(entry.token.removeprefix("token_id:")) if entry.token.startswith("token_id:") else None
           for entry in reply.choices[0].logprobs.content]  # fmt: skip
    assert reply.usage.completion_tokens == 12
    text, _ = await split.decoder.client.chat_text(
        [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=12, temperature=0, ignore_eos=True
    )
    assert reply.choices[0].message.content == text
    assert len(expected) == 12 and len(ids) == 12
