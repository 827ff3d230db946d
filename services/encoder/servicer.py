"""tandem.v1.Encoder: convert, validate, delegate to the embedder.

Embedding and tokenization run on one worker thread, off the event loop (and tokenizers release the
GIL), so health checks and reflection answer while a long input is being embedded; one thread
because torch already uses every core for a single call, and embedders are not thread-safe. A text
too long to fit is refused from its length before it is tokenized (`common/text_bounds.py`).

With telemetry on, each Embed gets an `embeddings {model}` span (a child of the gRPC server span)
and a request-duration point.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch

from common import telemetry as otel
from common import tensors, text_bounds
from common.errors import InvalidArgument, Unavailable
from common.model_name import check_model
from common.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc, tensor_pb2
from common.wire_limits import MAX_REQUEST_ID_BYTES, MAX_TOKENIZE_TEXTS
from services.encoder.config import EncoderConfig
from services.encoder.embedder import Embedder, Pooling

T = TypeVar("T")

# Room in a response for everything but the tensor bytes: token IDs (up to 5 bytes each) and framing.
RESPONSE_OVERHEAD_BYTES = 4096
BYTES_PER_TOKEN_ID = 5
_POOLINGS = {encoder_pb2.POOLING_NONE: Pooling.NONE, encoder_pb2.POOLING_MEAN: Pooling.MEAN}


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """Answers UNAVAILABLE until `attach` hands it the loaded embedder."""

    def __init__(self, config: EncoderConfig, telemetry: otel.Telemetry | None = None) -> None:
        self.config = config
        self._embedder: Embedder | None = None
        self._max_input_tokens = config.max_input_tokens  # min(config, embedder limit) once attached
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        # None when telemetry is off: Embed then records nothing at all.
        self._telemetry = telemetry if telemetry is not None and telemetry.is_enabled else None
        self._metrics = otel.ServerMetrics(telemetry.meter) if self._telemetry is not None else None

    def attach(self, embedder: Embedder) -> None:
        self._embedder = embedder
        limit = embedder.info.max_positions
        self._max_input_tokens = min(self.config.max_input_tokens, limit or self.config.max_input_tokens)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def Embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EmbedResponse:
        if self._telemetry is None or self._metrics is None:
            return await self._embed(request)
        op = otel.ServerOperation(
            self._telemetry, self._metrics, otel.OPERATION_EMBEDDINGS, self.config.served_model_name
        )
        try:
            response = await self._embed(request)
            op.set(
                {
                    otel.GEN_AI_RESPONSE_ID: response.request_id,
                    otel.GEN_AI_USAGE_INPUT_TOKENS: response.usage.input_tokens,
                    otel.GEN_AI_EMBEDDINGS_DIMENSION_COUNT: response.embeddings.shape[-1],
                }
            )
            return response
        except BaseException as exc:
            op.fail(exc)
            raise
        finally:
            op.end()

    async def _embed(self, request: encoder_pb2.EmbedRequest) -> encoder_pb2.EmbedResponse:
        embedder = self._require_embedder()
        info = embedder.info
        check_model(request.model, self.config.served_model_name)
        request_id = _request_id(request.request_id)
        pooling = _pooling(request.pooling, self.config.pooling)
        output_dtype = _output_dtype(request.output_dtype)
        source = request.WhichOneof("input")
        if source == "text":
            if not request.text:
                raise InvalidArgument("text", "must not be empty")
            # From its length alone first: tokenizing 30 MB took 27 s and 4 GB it never gave back.
            num_at_least = text_bounds.min_positions(request.text, info.max_token_chars)
            if num_at_least > self._max_input_tokens:
                raise InvalidArgument(
                    "text",
                    f"at least {num_at_least} positions (one per {info.max_token_chars} characters or "
                    f"fewer) exceed max_input_tokens {self._max_input_tokens}",
                )
            token_ids = await self._run(embedder.tokenize, request.text, request.add_special_tokens)
            if not token_ids:
                raise InvalidArgument("text", "produces no tokens; send text with at least one token")
        elif source == "token_ids":
            if not request.token_ids.ids:
                raise InvalidArgument("token_ids.ids", "must not be empty")
            token_ids = list(request.token_ids.ids)
        else:
            raise InvalidArgument("input", "set exactly one of text or token_ids")
        if len(token_ids) > self._max_input_tokens:
            raise InvalidArgument(
                source, f"{len(token_ids)} positions exceed max_input_tokens {self._max_input_tokens}"
            )
        if source == "token_ids":
            tensors.token_ids_to_list(token_ids, "token_ids.ids", info.vocab_size)
        num_rows = 1 if pooling is Pooling.MEAN else info.num_virtual_tokens + len(token_ids)
        itemsize = (output_dtype or info.dtype).itemsize
        num_bytes = num_rows * info.hidden_size * itemsize + len(token_ids) * BYTES_PER_TOKEN_ID
        max_bytes = self.config.server.max_message_bytes - RESPONSE_OVERHEAD_BYTES
        if num_bytes > max_bytes:
            raise InvalidArgument(
                source,
                f"the response would take about {num_bytes} bytes, over max_message_bytes "
                f"{self.config.server.max_message_bytes}; send a shorter input or a 2-byte output_dtype",
            )

        def embed_and_pack() -> tensor_pb2.Tensor:
            # Packing copies up to max_message_bytes: keep that off the event loop too.
            rows = embedder.embed(token_ids, pooling)  # [num_rows, hidden_size]
            return tensors.encode(rows, output_dtype)

        return encoder_pb2.EmbedResponse(
            request_id=request_id,
            embeddings=await self._run(embed_and_pack),
            token_ids=tensor_pb2.TokenIds(ids=token_ids),
            usage=tensor_pb2.Usage(input_tokens=len(token_ids)),
        )

    async def Tokenize(
        self, request: encoder_pb2.EncoderTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderTokenizeResponse:
        embedder = self._require_embedder()
        if len(request.texts) > MAX_TOKENIZE_TEXTS:
            raise InvalidArgument(
                "texts", f"{len(request.texts)} texts exceed the limit of {MAX_TOKENIZE_TEXTS} per call"
            )
        texts, add_special_tokens = list(request.texts), request.add_special_tokens
        text_bounds.check_tokenize_bound(
            texts, embedder.info.max_token_chars, self._max_input_tokens, "max_input_tokens"
        )

        def tokenize_all() -> list[list[int]]:
            return [embedder.tokenize(text, add_special_tokens) for text in texts]

        token_lists = await self._run(tokenize_all)
        tokens = [tensor_pb2.TokenIds(ids=ids) for ids in token_lists]
        return encoder_pb2.EncoderTokenizeResponse(tokens=tokens)

    async def GetModelInfo(
        self, request: encoder_pb2.EncoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderGetModelInfoResponse:
        info = self._require_embedder().info
        return encoder_pb2.EncoderGetModelInfoResponse(
            model=self.config.served_model_name,
            embedder=info.kind,
            hidden_size=info.hidden_size,
            dtype=tensors.to_wire_dtype(info.dtype),
            vocab_size=info.vocab_size,
            max_input_tokens=self._max_input_tokens,
            max_message_bytes=self.config.server.max_message_bytes,
            num_virtual_tokens=info.num_virtual_tokens,
        )

    def _require_embedder(self) -> Embedder:
        if self._embedder is None:
            raise Unavailable("the embedder is still loading; retry shortly")
        return self._embedder

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def _request_id(request_id: str) -> str:
    if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_BYTES} bytes")
    return request_id or uuid.uuid4().hex


def _pooling(pooling: int, default: Pooling) -> Pooling:
    if pooling == encoder_pb2.POOLING_UNSPECIFIED:
        return default
    if pooling not in _POOLINGS:
        raise InvalidArgument("pooling", f"unknown pooling {pooling}; use POOLING_NONE or POOLING_MEAN")
    return _POOLINGS[pooling]


def _output_dtype(dtype: int) -> torch.dtype | None:
    """None = the embedder's native dtype."""
    if dtype == tensor_pb2.DATA_TYPE_UNSPECIFIED:
        return None
    if dtype not in tensors.FLOAT_DATA_TYPES:
        name = tensor_pb2.DataType.Name(dtype) if dtype in tensor_pb2.DataType.values() else str(dtype)
        raise InvalidArgument(
            "output_dtype",
            f"{name} is not supported; use DATA_TYPE_FLOAT32, DATA_TYPE_FLOAT16 or DATA_TYPE_BFLOAT16",
        )
    return tensors.to_torch_dtype(dtype, "output_dtype")
