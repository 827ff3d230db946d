"""A tiny LLaVA checkpoint split in two and served: the encoder with its image half, the decoder with
its language model, both float32, on loopback; and transformers' whole model as the reference."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.encoder.tests.vision_checkpoints import make_image, make_llava
from tandem.client.client import EncoderClient
from tandem.common.server import ServerOptions
from tandem.decoder.models.loader import LoadedModel, load_model
from tandem.encoder.config import EncoderConfig
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tests.integration.decoder.conftest import Served, serve, shutdown
from tests.integration.encoder.conftest import Encoder, start_encoder, stop_encoder

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava") / "tiny-llava", tower="clip")


@pytest.fixture(scope="session")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pictures")
    return {
        "landscape.png": make_image(folder / "landscape.png", (53, 41), seed=1),
        "portrait.jpg": make_image(folder / "portrait.jpg", (30, 70), seed=2),
        "square.webp": make_image(folder / "square.webp", (36, 36), seed=3),
    }


@pytest.fixture(scope="session")
def llava_language_model(llava_dir: Path) -> LoadedModel:
    return load_model(llava_dir, dtype="float32")


@pytest.fixture(scope="session")
def llava_images(llava_dir: Path) -> VisionLanguageEmbedder:
    return VisionLanguageEmbedder.load(llava_dir, torch.float32)


@pytest.fixture(scope="session")
def reference(llava_dir: Path) -> Any:
    """transformers' LlavaForConditionalGeneration and processor, the whole model in one."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # 16 tokens, as ignore_eos gives
    return model, AutoProcessor.from_pretrained(llava_dir)


@dataclass
class Split:
    encoder: Encoder
    decoder: Served
    images: EncoderClient


def encoder_config(model_dir: Path, **overrides: Any) -> EncoderConfig:
    return EncoderConfig(
        model_dir=model_dir,
        dtype="float32",
        server=ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
        **overrides,
    )


@pytest.fixture
async def split(
    llava_dir: Path, llava_language_model: LoadedModel, llava_images: VisionLanguageEmbedder
) -> AsyncIterator[Split]:
    encoder = await start_encoder(encoder_config(llava_dir), llava_images)  # type: ignore[arg-type]
    decoder = await serve(llava_dir, llava_language_model, num_kv_blocks=512, block_size=16)
    images = EncoderClient(encoder.server.address, MAX_MESSAGE_BYTES)
    try:
        yield Split(encoder, decoder, images)
    finally:
        await images.close()
        await shutdown(decoder)
        await stop_encoder(encoder)
