"""`tandem.v1.Decoder`: convert, validate, delegate. No scheduling or tensor math lives here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common import tensors
from common.errors import InvalidArgument, NotFound, Unavailable
from common.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, tensor_pb2
from services.decoder import protocol
from services.decoder.engine import Engine
from services.decoder.outputs import Failed


class DecoderServicer(decoder_pb2_grpc.DecoderServicer):
    def __init__(
        self, model_name: str, max_message_bytes: int, world_size: int = 1, engine: Engine | None = None
    ) -> None:
        self.model_name = model_name
        self.max_message_bytes = max_message_bytes
        self.world_size = world_size
        self.engine = engine  # None while loading: every RPC answers UNAVAILABLE
        # An embedding tensor can never be larger than a message, so the element cap follows from it.
        self.tensor_limits = tensors.TensorLimits(max_elements=max_message_bytes // 2)

    def _engine(self) -> Engine:
        if self.engine is None or not self.engine.is_healthy:
            raise Unavailable("the decoder is loading, draining or has failed; retry later")
        return self.engine

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise NotFound(f"model {model!r} is not served here (this server serves {self.model_name!r})")

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        engine = self._engine()
        self._check_model(request.model)
        spec = protocol.spec_from_pb(
            request,
            engine.model_config.hidden_size,
            engine.config.enable_prompt_embeds,
            self.tensor_limits,
            context.time_remaining(),
        )
        # Leaving this loop for any reason (client cancel, deadline, error) aborts the request.
        async for event in engine.stream(spec):
            if isinstance(event, Failed):
                raise event.error
            yield protocol.event_to_pb(event)

    async def Tokenize(
        self, request: decoder_pb2.DecoderTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderTokenizeResponse:
        engine = self._engine()
        if len(request.texts) > protocol.MAX_TOKENIZE_TEXTS:
            raise InvalidArgument("texts", f"at most {protocol.MAX_TOKENIZE_TEXTS} texts per call")
        encodings = engine.tokenizer.encode_batch(
            list(request.texts), add_special_tokens=request.add_special_tokens
        )
        return decoder_pb2.DecoderTokenizeResponse(tokens=[tensor_pb2.TokenIds(ids=e.ids) for e in encodings])

    async def GetModelInfo(
        self, request: decoder_pb2.DecoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderGetModelInfoResponse:
        engine = self._engine()
        c = engine.model_config
        return decoder_pb2.DecoderGetModelInfoResponse(
            model=self.model_name,
            architecture=c.architecture,
            dtype=protocol.dtype_to_pb(c.dtype),
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            max_context_tokens=engine.max_model_len,
            eos_token_ids=sorted(engine.eos_token_ids),
            accepts_prompt_embeds=engine.config.enable_prompt_embeds,
            max_message_bytes=self.max_message_bytes,
            world_size=self.world_size,
            max_queued_requests=engine.config.max_queue,
        )
