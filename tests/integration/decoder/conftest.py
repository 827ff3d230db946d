"""A real decoder server on a free loopback port, in this process, on the tiny default model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.client.client import DecoderClient
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.api.servicer import DecoderServicer
from tandem.decoder.api.token_table import checkpoint_sample, checkpoint_weight_samples
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import LoadedModel

MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclass
class Served:
    server: RunningServer
    engine: Engine
    client: DecoderClient


async def serve(
    model_dir: Path,
    loaded: LoadedModel,
    encoder_parts: EncoderParts | None = None,
    model_name: str | None = None,  # None: the directory's name
    **engine_overrides,
) -> Served:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=1024, block_size=4, max_num_seqs=64)
    settings.update(engine_overrides)
    engine = Engine(EngineConfig(**settings), loaded).start()
    servicer = DecoderServicer(
        model_name or model_dir.name,
        MAX_MESSAGE_BYTES,
        engine=engine,
        encoder_parts=encoder_parts,
        token_table_sample=checkpoint_sample(model_dir),  # as `tandem serve decoder` reports it
        weight_samples=checkpoint_weight_samples(model_dir),
    )
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    await server.set_serving()
    return Served(server, engine, DecoderClient(server.address, MAX_MESSAGE_BYTES))


async def shutdown(served: Served) -> None:
    await served.client.close()
    await served.server.stop(0)
    served.engine.shutdown()


@pytest.fixture
async def decoder(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> AsyncIterator[Served]:
    served = await serve(tiny_model_dir, tiny_fp32)
    yield served
    await shutdown(served)
