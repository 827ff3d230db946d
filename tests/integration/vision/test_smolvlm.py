"""A SmolVLM (Idefics3) checkpoint served split in two: a picture's tiles and their markers through the
encoder, the language model in the decoder, against transformers' whole model (float32, random)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from services.encoder.tests.smolvlm_checkpoint import make_smolvlm
from tandem.client.client import EncoderClient
from tandem.common.torch_part import tensors
from tandem.decoder.models.loader import load_model
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.encoder.conftest import start_encoder, stop_encoder
from tests.integration.vision.conftest import MAX_MESSAGE_BYTES, Split, encoder_config
from tests.integration.vision.test_language_model_weights import assert_no_weight_named

QUESTION = "Describe this picture."


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_smolvlm(tmp_path_factory.mktemp("smolvlm") / "tiny-smolvlm", splitting=True)


def test_the_start_up_check_names_no_weight_of_the_tower_or_the_connector(
    smolvlm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert_no_weight_named(smolvlm_dir, caplog)


@pytest.fixture(scope="module")
def reference(smolvlm_dir: Path) -> Any:
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(smolvlm_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # 16 tokens, as ignore_eos gives
    return model, AutoProcessor.from_pretrained(smolvlm_dir)


@pytest.fixture
async def split(smolvlm_dir: Path) -> AsyncIterator[Split]:
    encoder = await start_encoder(
        encoder_config(smolvlm_dir),
        VisionLanguageEmbedder.load(smolvlm_dir, torch.float32),  # type: ignore[arg-type]
    )
    decoder = await serve(smolvlm_dir, load_model(smolvlm_dir, "float32"), num_kv_blocks=512, block_size=16)
    images = EncoderClient(encoder.server.address, MAX_MESSAGE_BYTES)
    try:
        yield Split(encoder, decoder, images)
    finally:
        await images.close()
        await shutdown(decoder)
        await stop_encoder(encoder)


def _reference_inputs(reference: Any, picture: Path, question: str) -> dict:
    _, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=[Image.open(picture)], text=prompt, return_tensors="pt")


async def test_a_chat_with_a_picture_gives_transformers_greedy_tokens(
    split: Split, reference: Any, pictures: dict[str, Path]
) -> None:
    model, _ = reference
    for name, picture in pictures.items():
        inputs = _reference_inputs(reference, picture, QUESTION)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        image = await split.images.embed_image(picture.read_bytes())
        call = split.decoder.client.chat(
            [{"role": "user", "content": [image, QUESTION]}],
            max_new_tokens=16,
            temperature=0,
            ignore_eos=True,
        )
        ours = [t async for r in call if r.HasField("delta") for t in r.delta.token_ids]
        assert ours == expected, name
        assert len(set(ours)) > 3, ours


async def test_the_span_is_the_processors_expansion_with_the_models_rows(
    split: Split, reference: Any, pictures: dict[str, Path]
) -> None:
    """The encoder's token IDs are what the processor writes for one <image>, tiles and markers; its
    rows are the model's own input embeddings at those positions (image features merged in)."""
    model, processor = reference
    picture = pictures["landscape.png"]
    reply = await split.images.embed(image=picture.read_bytes())
    inputs = _reference_inputs(reference, picture, QUESTION)
    ids = inputs["input_ids"][0].tolist()
    span = list(reply.token_ids.ids)
    start = next(i for i in range(len(ids)) if ids[i : i + len(span)] == span)
    assert span.count(model.config.image_token_id) == 5 * 16 // 4  # 2 x 2 tiles + the global image
    with torch.no_grad():
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"])
        features = getattr(features, "pooler_output", features)
        features = torch.cat(list(features)) if isinstance(features, list | tuple) else features
        mask = inputs["input_ids"] == model.config.image_token_id
        embeds = embeds.masked_scatter(mask[..., None], features.reshape(-1, embeds.shape[-1]))
    rows = tensors.decode(reply.embeddings, "embeddings")
    torch.testing.assert_close(rows, embeds[0, start : start + len(span)], atol=1e-5, rtol=0)
    assert reply.placeholder == "<image>"


async def test_the_end_of_turn_is_read_off_a_template_that_takes_content_as_items(split: Split) -> None:
    """SmolVLM's template renders nothing of string content; the end of turn is found all the same."""
    chat_template = split.decoder.engine.chat_template
    assert chat_template.end_of_turn_ids == (chat_template.tokenizer.token_to_id("<end_of_utterance>"),)
