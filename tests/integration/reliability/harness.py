"""Both services in a background event loop, for tests that drive them with blocking clients.

Hypothesis and plain loops are simplest with the synchronous grpc API; the servers still run on
grpc.aio in their own thread, exactly as in production.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from tandem.client.channel import channel_options
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc, encoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, TlsOptions, start_server
from tandem.decoder.api.servicer import DecoderServicer
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.config import EncoderConfig
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.servicer import EncoderServicer

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_MODEL_LEN = 256
ENCODER_MAX_INPUT_TOKENS = 64


@dataclass
class Limits:
    max_num_seqs: int = 16
    max_queue: int = 64
    num_kv_blocks: int = 512
    max_model_len: int = MAX_MODEL_LEN
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_streams_per_connection: int | None = None  # the documented default is 32; None: no bound
    max_streams_per_token: int | None = None  # with auth tokens; the documented default is 256
    shared_step_seqs: int | None = None  # None: the backend's (8 on a CPU)


class Services:
    """Decoder and encoder on free loopback ports; `decoder`/`encoder` are blocking stubs (plaintext,
    so with `tls` set tests open their own channels)."""

    def __init__(
        self,
        model_dir: Path,
        loaded: LoadedModel,
        limits: Limits | None = None,
        tls: TlsOptions | None = None,
        auth_tokens: frozenset[str] = frozenset(),
    ) -> None:
        limits = limits or Limits()
        self.limits = limits
        self.server_options = ServerOptions(
            host="127.0.0.1",
            port=0,
            max_message_bytes=limits.max_message_bytes,
            tls=tls,
            auth_tokens=auth_tokens,
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self._thread.start()
        self.engine = Engine(
            EngineConfig(
                model_dir=model_dir,
                dtype=str(loaded.config.dtype).removeprefix("torch."),  # the loaded model's
                block_size=4,
                max_model_len=limits.max_model_len,
                max_num_seqs=limits.max_num_seqs,
                max_queue=limits.max_queue,
                num_kv_blocks=limits.num_kv_blocks,
                shared_step_seqs=limits.shared_step_seqs,
            ),
            loaded,
        ).start()
        self.encoder_config = EncoderConfig(
            model_dir=model_dir,
            dtype="float32",
            max_input_tokens=ENCODER_MAX_INPUT_TOKENS,
            server=self.server_options,
        )
        self.encoder_servicer = EncoderServicer(self.encoder_config)
        self.encoder_servicer.attach(LookupEmbedder.load(model_dir, torch.float32))
        self.decoder_server: RunningServer = self.run(self._start_decoder(model_dir))
        self.encoder_server: RunningServer = self.run(self._start_encoder())
        self.decoder_channel = grpc.insecure_channel(
            self.decoder_server.address, options=channel_options(limits.max_message_bytes)
        )
        self.encoder_channel = grpc.insecure_channel(
            self.encoder_server.address, options=channel_options(limits.max_message_bytes)
        )
        self.decoder = decoder_pb2_grpc.DecoderStub(self.decoder_channel)
        self.encoder = encoder_pb2_grpc.EncoderStub(self.encoder_channel)

    def run(self, coroutine: Any) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=60)

    async def _start_decoder(self, model_dir: Path) -> RunningServer:
        servicer = DecoderServicer(
            model_dir.name,
            self.limits.max_message_bytes,
            engine=self.engine,
            max_streams_per_connection=self.limits.max_streams_per_connection,
            identify_by_token=bool(self.server_options.auth_tokens),
            max_streams_per_token=self.limits.max_streams_per_token,
        )
        server = await start_server(
            self.server_options,
            [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
        )
        await server.set_serving()
        return server

    async def _start_encoder(self) -> RunningServer:
        server = await start_server(
            self.encoder_config.server,
            [self.encoder_servicer.service()],
        )
        await server.set_serving()
        return server

    def idle(self, timeout: float = 10.0) -> bool:
        """True once the engine holds no request and every KV block is free again."""
        import time

        blocks = self.engine.core.block_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.core.num_live() == 0 and blocks.num_free_blocks == blocks.num_total_blocks:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.decoder_channel.close()
        self.encoder_channel.close()
        self.run(self.decoder_server.stop(0))
        self.run(self.encoder_server.stop(0))
        self.engine.shutdown()
        self.encoder_servicer.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
