"""A LLaVA whose language model is a Qwen2 (llava-interleave-qwen's kind) served split in two: the
decoder runs it as a Qwen2ForCausalLM (q/k/v biases, Qwen2's defaults), the encoder its picture, both
against transformers' whole model (float32, random)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.encoder.tests.vision_checkpoints import make_image, make_llava
from tandem.client.client import EncoderClient
from tandem.decoder.models.loader import load_model
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.encoder.conftest import start_encoder, stop_encoder
from tests.integration.vision.conftest import MAX_MESSAGE_BYTES, Split, encoder_config
from tests.integration.vision.test_language_model_weights import assert_no_weight_named
from tests.integration.vision.test_llava import QUESTION, _chat_tokens, _reference_greedy

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def llava_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava-qwen2") / "tiny-llava-qwen2", text_model="qwen2")


@pytest.fixture(scope="module")
def reference(llava_qwen2_dir: Path) -> Any:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_qwen2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # 16 tokens, as ignore_eos gives
    return model, AutoProcessor.from_pretrained(llava_qwen2_dir)


def test_the_start_up_check_takes_its_q_k_v_biases_as_qwen2s_and_names_no_weight(
    llava_qwen2_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert_no_weight_named(llava_qwen2_dir, caplog)


async def test_the_decoder_serves_a_qwen2_language_model_with_transformers_greedy_tokens(
    llava_qwen2_dir: Path, reference: Any
) -> None:
    model, processor = reference
    assert model.config.text_config.model_type == "qwen2"
    loaded = load_model(llava_qwen2_dir, dtype="float32")
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.qkv_bias
    ids = processor.tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    served = await serve(llava_qwen2_dir, loaded, num_kv_blocks=64, block_size=16)
    try:
        call = served.client.generate([PROMPT], max_new_tokens=16, temperature=0.0, ignore_eos=True)
        ours = [t async for r in call if r.HasField("delta") for t in r.delta.token_ids]
    finally:
        await shutdown(served)
    assert ours == expected
    assert len(set(ours)) > 3, ours  # the weights make a varied answer, not one token repeated


async def test_a_chat_with_a_picture_over_a_qwen2_language_model_gives_transformers_greedy_tokens(
    llava_qwen2_dir: Path, reference: Any, tmp_path: Path
) -> None:
    """The encoder reads the Qwen2 model's token table and the CLIP tower as it does a Llama LLaVA's."""
    picture = make_image(tmp_path / "landscape.png", (53, 41), seed=1)
    images = VisionLanguageEmbedder.load(llava_qwen2_dir, torch.float32)
    encoder = await start_encoder(encoder_config(llava_qwen2_dir), images)  # type: ignore[arg-type]
    decoder = await serve(
        llava_qwen2_dir, load_model(llava_qwen2_dir, dtype="float32"), num_kv_blocks=64, block_size=16
    )
    client = EncoderClient(encoder.server.address, MAX_MESSAGE_BYTES)
    try:
        split = Split(encoder, decoder, client)
        image = await client.embed_image(picture.read_bytes())
        ours = await _chat_tokens(split, [image, QUESTION])
    finally:
        await client.close()
        await shutdown(decoder)
        await stop_encoder(encoder)
    assert ours == _reference_greedy(reference, picture, QUESTION)
