"""A real encoder server on loopback, over a tiny decoder checkpoint written once per session."""

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from tandem.client.channel import channel_options
from tandem.client.pb.tandem.v1 import encoder_pb2_grpc
from tandem.common import replica_name
from tandem.common.server import RunningServer, ServerOptions, start_server
from tandem.encoder.config import EncoderConfig
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.servicer import EncoderServicer

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_INPUT_TOKENS = 64
MODEL_NAME = "tiny-qwen3"


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def lookup(tiny_model: Path) -> LookupEmbedder:
    """Loaded once and attached to every test's server: loading is what is slow, not serving."""
    return LookupEmbedder.load(tiny_model, torch.bfloat16)


@dataclass
class Encoder:
    server: RunningServer
    servicer: EncoderServicer
    channel: grpc.aio.Channel
    stub: encoder_pb2_grpc.EncoderStub


async def start_encoder(config: EncoderConfig, embedder: LookupEmbedder | None) -> Encoder:
    servicer = EncoderServicer(config)
    server = await start_server(config.server, [servicer.service()])
    servicer.replica = replica_name.own_name(config.server.host, server.port)
    if embedder is not None:
        servicer.attach(embedder)
        await server.set_serving()
    channel = grpc.aio.insecure_channel(server.address, options=channel_options(MAX_MESSAGE_BYTES))
    return Encoder(server, servicer, channel, encoder_pb2_grpc.EncoderStub(channel))


async def stop_encoder(encoder: Encoder) -> None:
    await encoder.channel.close()
    await encoder.server.stop(0)
    encoder.servicer.close()


def encoder_config(tiny_model: Path) -> EncoderConfig:
    return EncoderConfig(
        model_dir=tiny_model,
        max_input_tokens=MAX_INPUT_TOKENS,
        model_name=MODEL_NAME,
        server=ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
    )


@pytest.fixture
async def encoder(tiny_model: Path, lookup: LookupEmbedder) -> AsyncIterator[Encoder]:
    running = await start_encoder(encoder_config(tiny_model), lookup)
    try:
        yield running
    finally:
        await stop_encoder(running)
