"""A live gateway in front of a live decoder and encoder (the tiny model, float32), on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.lookup import LookupEmbedder
from tandem.gateway.__main__ import serve as serve_gateway
from tandem.gateway.config import GatewayConfig
from tests.integration.decoder.conftest import Served, serve, shutdown
from tests.integration.encoder.conftest import Encoder, encoder_config, start_encoder, stop_encoder


@dataclass
class Live:
    base_url: str  # http://127.0.0.1:PORT/v1
    decoder: Served
    encoder: Encoder


async def start_gateway(config: GatewayConfig) -> tuple[asyncio.Task[None], int]:
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve_gateway(config, ready))
    return task, await asyncio.wait_for(ready, 30)


async def stop_gateway(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@pytest.fixture
async def live(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> AsyncIterator[Live]:
    decoder = await serve(tiny_model_dir, tiny_fp32)
    embedder = LookupEmbedder.load(tiny_model_dir, torch.float32)
    encoder = await start_encoder(encoder_config(tiny_model_dir), embedder)
    task, port = await start_gateway(
        GatewayConfig(
            decoder_address=decoder.server.address,
            encoder_address=encoder.server.address,
            port=0,
            max_streams_per_caller=4,
        )
    )
    try:
        yield Live(f"http://127.0.0.1:{port}/v1", decoder, encoder)
    finally:
        await stop_gateway(task)
        await stop_encoder(encoder)
        await shutdown(decoder)
