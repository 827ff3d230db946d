"""tandem.v1.Encoder: convert, delegate to the request builder and the embedder. The rules live in
`request.py`; errors map to statuses in `tandem.client.status`.

Request building (tokenizing included), embedding and Tokenize run on one worker thread, off the
event loop (and tokenizers release the GIL), so health checks and reflection answer while a long
input is being embedded; one thread because torch already uses every core for a single call, and
embedders are not thread-safe. Embedding itself goes through the batcher: concurrent calls run as
one batch on that thread (`batcher.py`, `batch.py`), an image's decoding included, so the event loop
never touches image bytes beyond counting them. A model that takes images keeps that thread for its
tower, and text (building, Tokenize, its own batches of table lookups) gets a second one: a text
Embed waited 4.3-8.8 s behind batches of large images, where it now takes its lookup's time. The two
share nothing but the token table, which both only read.

A call from a caller on this host that offers shared memory (a decoder fetching its `encoder` parts)
gets its rows in a segment rather than in the reply (`shared_segments.py`), written by its batch.

With telemetry on, each Embed gets an `embeddings {model}` span (a child of the gRPC server span)
and a request-duration point.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import grpc
import torch
from google.protobuf import message_factory

from tandem.client import telemetry as otel
from tandem.client.errors import InvalidArgument, Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc, tensor_pb2
from tandem.common import replica_name
from tandem.common.dtypes import FLOAT_DATA_TYPES
from tandem.common.model_name import check_model
from tandem.common.server import Service
from tandem.common.token_table_sample import TableSample, sample_to_pb
from tandem.common.torch_part import tensors
from tandem.common.torch_part.model_identity import read_table_sample
from tandem.common.torch_part.prompt_parts import TextPrompt
from tandem.common.wire_limits import check_tokenize_texts
from tandem.encoder.batch import EmbedOutput, run_batch
from tandem.encoder.batcher import Batcher
from tandem.encoder.config import SMALL_FIELDS_BYTES, EncoderConfig
from tandem.encoder.embedder import Embedder, EmbedderLoadError, Pooling
from tandem.encoder.request import (
    EmbedJob,
    EmbedSpec,
    ImageBytes,
    ImageJob,
    ImageLimits,
    build_image_job,
    build_job,
)
from tandem.encoder.request_size import parse_embed_request
from tandem.encoder.shared_segments import SharedSegments, SharedTarget

T = TypeVar("T")

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name  # "tandem.v1.Encoder"

# The decoding and preparing an image batch takes on at most (estimated from the headers,
# `ImageJob.expected_s`), whatever max_batch_size allows: for LLaVA-1.5 eight pictures of 640 x 480, six
# of 1 Mpx, or one of 8 Mpx or more. SmolVLM's are weighed by the resizes and tiles its processor makes
# (it scales each picture to 2,048 on its long side and cuts up to 17 tiles of 512 x 512), more than by
# the picture's own pixels: a photo, a square or a 2:1 picture weighs over half the bound (640 x 480 0.21 s,
# 36 x 36 0.27, 1024 x 512 0.16; 0.26-0.37 s measured), so most go one to a batch; about 4:1, one row of
# tiles, weighs 0.08-0.09 s (2048 x 512, 400 x 100, 1024 x 256): two or three to a batch.
MAX_BATCH_DECODE_S = 0.25

_POOLINGS = {encoder_pb2.POOLING_NONE: Pooling.NONE, encoder_pb2.POOLING_MEAN: Pooling.MEAN}


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """Answers UNAVAILABLE until `attach` hands it the loaded embedder."""

    def __init__(self, config: EncoderConfig, telemetry: otel.Telemetry | None = None) -> None:
        self.config = config
        self._embedder: Embedder | None = None
        self._table_sample: TableSample | None = None  # model_dir's token table, once attached
        # The same, as every Embed reply carries it (a decoder checks each reply's model): built once.
        self._table_sample_pb: encoder_pb2.TokenTableSample | None = None
        self._max_input_tokens = config.max_input_tokens  # min(config, embedder limit) once attached
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        self._batcher: Batcher[EmbedJob | ImageJob, EmbedOutput] | None = None  # once attached
        # A model that takes images: text's own thread and batches, beside the tower's. Otherwise
        # text shares the one worker (a projector's network runs fastest where it was loaded).
        self._text_executor = self._executor
        self._text_batcher: Batcher[EmbedJob | ImageJob, EmbedOutput] | None = None  # once attached
        self._image_limits = ImageLimits(config.image_bytes_limit, config.max_image_pixels)
        self.segments = (
            SharedSegments(
                config.shared_memory_dir,
                config.shared_memory_bytes,
                config.shared_memory_segments,
                config.shared_memory_lease_s,
            )
            if config.shared_memory_bytes > 0
            else None
        )
        self.num_embeds = 0  # Embed calls answered (what a caller's embedding cache saves)
        # This server's own name, sent as each Embed and GetModelInfo call begins, so that a caller
        # balancing over several encoders names the one that answered (`replica_name`). Set once it
        # listens (its port may be the system's choice); "": not sent.
        self.replica = ""
        # None when telemetry is off: Embed then records nothing at all.
        self._telemetry = telemetry if telemetry is not None and telemetry.is_enabled else None
        self._metrics = otel.ServerMetrics(telemetry.meter) if self._telemetry is not None else None

    def attach(self, embedder: Embedder) -> None:
        """Serve `embedder`, loaded from config.model_dir. Raises EmbedderLoadError when that checkpoint
        has no token table to sample (GetModelInfo reports the sample: a decoder checks it)."""
        self._table_sample = read_table_sample(self.config.model_dir, EmbedderLoadError)
        self._table_sample_pb = sample_to_pb(self._table_sample)
        self._embedder = embedder
        limit = embedder.info.max_positions
        self._max_input_tokens = min(self.config.max_input_tokens, limit or self.config.max_input_tokens)
        wait_s = self.config.max_batch_wait_ms / 1000
        self._batcher = Batcher(
            self._executor,
            partial(run_batch, embedder),
            self.config.max_batch_size,
            # An image (tens of ms in the tower) waits for company; text (a lookup, well under a
            # millisecond) never does: a 2 ms wait took a lone text Embed from 0.73 to 2.9 ms.
            lambda job: wait_s if isinstance(job, ImageJob) else 0.0,
            # Cheapest first, and no more than MAX_BATCH_DECODE_S of decoding a batch (`batcher.py`):
            # one caller's large pictures do not hold another's small one for the length of them all.
            cost=lambda job: job.expected_s if isinstance(job, ImageJob) else 0.0,
            max_batch_cost=MAX_BATCH_DECODE_S,
        )
        self._text_batcher = self._batcher
        if embedder.info.image_placeholder:
            self._text_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder-text")
            self._text_batcher = Batcher(
                self._text_executor,
                partial(run_batch, embedder),
                self.config.max_batch_size,
                _no_wait,
            )

    def close(self, wait: bool = True) -> None:
        """Ends the calls left and stops the worker threads; `wait` False leaves a step still running
        (an embedder's load, which nothing can interrupt) to end with the process."""
        self.end_calls()
        self._text_executor.shutdown(wait=wait)
        self._executor.shutdown(wait=wait)
        if self.segments is not None:
            self.segments.close()

    def end_calls(self) -> int:
        """Ends every Embed call queued or in a batch with UNAVAILABLE, and every later one; a running
        batch skips the images it has not prepared yet. Returns how many calls it ended."""
        batchers = {id(b): b for b in (self._batcher, self._text_batcher) if b is not None}
        return sum(batcher.close(_shutting_down) for batcher in batchers.values())

    def max_embed_request_bytes(self) -> int | None:
        """The most bytes an Embed request can usefully have (None until attached): max_input_tokens
        positions of text (UTF-8, at most 4 bytes a character, `max_token_chars` characters a
        position) or of token IDs (at most 5 bytes each), plus room for the small fields. A longer
        request is refused from its size, unparsed (Service.max_request_bytes)."""
        if self._embedder is None:
            return None
        per_position = max(5, 4 * self._embedder.info.max_token_chars)
        longest = self._max_input_tokens * per_position
        if self._embedder.info.image_placeholder:
            longest = max(longest, self.config.image_bytes_limit)
        return longest + SMALL_FIELDS_BYTES

    def service(self) -> Service:
        """This servicer as the server mounts it: Embed's requests parsed by `parse_embed`, which refuses
        one over max_embed_request_bytes unparsed (the interceptor's own bound would name an image's
        field `image`, not the `image.data` of the limit it broke)."""
        return Service(SERVICE_NAME, self, _add_to_server)

    def parse_embed(self, raw: bytes) -> encoder_pb2.EmbedRequest:
        """An Embed request from its bytes, on the event loop as gRPC reads it (request_size.py)."""
        takes_images = self._embedder is None or bool(self._embedder.info.image_placeholder)
        return parse_embed_request(
            raw, self.max_embed_request_bytes(), self.config.image_bytes_limit, takes_images
        )

    async def Embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EmbedResponse:
        await self._say_who(context)
        if self._telemetry is None or self._metrics is None:
            return await self._embed(request, context)
        op = otel.ServerOperation(
            self._telemetry, self._metrics, otel.OPERATION_EMBEDDINGS, self.config.served_model_name
        )
        try:
            response = await self._embed(request, context)
            op.set(
                {
                    otel.GEN_AI_RESPONSE_ID: response.request_id,
                    otel.GEN_AI_USAGE_INPUT_TOKENS: response.usage.input_tokens,
                    otel.GEN_AI_EMBEDDINGS_DIMENSION_COUNT: _rows(response).shape[-1],
                }
            )
            return response
        except BaseException as exc:
            op.fail(exc)
            raise
        finally:
            op.end()

    async def _embed(
        self, request: encoder_pb2.EmbedRequest, context: grpc.aio.ServicerContext | None
    ) -> encoder_pb2.EmbedResponse:
        embedder = self._require_embedder()
        check_model(request.model, self.config.served_model_name)
        spec = _spec_from_pb(request)
        max_message_bytes = self.config.server.max_message_bytes
        job: EmbedJob | ImageJob
        watch: _SegmentWatch | None = None
        if isinstance(spec.input, ImageBytes):
            job = build_image_job(
                spec,
                embedder,
                self._image_limits,
                self._max_input_tokens,
                max_message_bytes,
                self.config.pooling,
            )
        else:
            job = await _on(
                self._text_executor,
                build_job,
                spec,
                embedder,
                self._max_input_tokens,
                max_message_bytes,
                self.config.pooling,
            )
        if request.HasField("shared_memory") and self.segments is not None:
            target = self.segments.target(request.shared_memory)
            if target is not None:
                job = dataclasses.replace(job, shared=target)
                if context is not None:  # None: called directly, not served
                    watch = _SegmentWatch(target)
                    context.add_done_callback(watch.call_ended)
        batcher = self._batcher if isinstance(job, ImageJob) else self._text_batcher
        assert batcher is not None  # set with the embedder
        # Embedding, an image's decoding and packing (a copy of up to max_message_bytes, into the
        # reply or a segment) all run in the batch, on its worker thread.
        output = await batcher.submit(job)
        self.num_embeds += 1
        is_shared = isinstance(output.embeddings, tensor_pb2.SharedTensor)
        if watch is not None:
            watch.replied = True
        return encoder_pb2.EmbedResponse(
            request_id=job.request_id,
            token_ids=tensor_pb2.TokenIds(ids=output.token_ids),
            usage=tensor_pb2.Usage(input_tokens=len(output.token_ids)),
            placeholder=output.placeholder,
            model=self.config.served_model_name,
            token_table_sample=self._table_sample_pb,
            **{"shared_embeddings" if is_shared else "embeddings": output.embeddings},  # type: ignore[arg-type]
        )

    async def Tokenize(
        self, request: encoder_pb2.EncoderTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderTokenizeResponse:
        embedder = self._require_embedder()
        texts, add_special_tokens = list(request.texts), request.add_special_tokens
        check_tokenize_texts(texts, embedder.info.max_token_chars, self._max_input_tokens, "max_input_tokens")

        def tokenize_all() -> list[list[int]]:
            return [embedder.tokenize(text, add_special_tokens) for text in texts]

        token_lists = await _on(self._text_executor, tokenize_all)
        tokens = [tensor_pb2.TokenIds(ids=ids) for ids in token_lists]
        return encoder_pb2.EncoderTokenizeResponse(tokens=tokens)

    async def GetModelInfo(
        self, request: encoder_pb2.EncoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderGetModelInfoResponse:
        await self._say_who(context)
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
            accepts_images=bool(info.image_placeholder),
            image_placeholder=info.image_placeholder,
            max_image_bytes=self.config.image_bytes_limit if info.image_placeholder else 0,
            max_image_pixels=self.config.max_image_pixels if info.image_placeholder else 0,
            max_batch_size=self.config.max_batch_size,
            max_batch_wait_s=self.config.max_batch_wait_ms / 1000,
            token_table_sample=self._table_sample_pb,
        )

    async def _say_who(self, context: grpc.aio.ServicerContext) -> None:
        """This server's name, in the initial metadata sent now, before any work: a call that then
        fails, or hangs past its deadline, still tells its caller which replica it reached."""
        if self.replica:
            await context.send_initial_metadata(((replica_name.HEADER, self.replica),))

    def _require_embedder(self) -> Embedder:
        if self._embedder is None:
            raise Unavailable("the embedder is still loading; retry shortly")
        return self._embedder

    async def on_worker(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the worker thread. The embedder is loaded there too: torch on 2 cores ran a
        SigLIP-B/16 tower 15-30 % slower on a thread other than the one that loaded its weights (the
        loader's OpenMP team and the worker's competing; measured in issue 33)."""
        return await _on(self._executor, fn, *args)


async def _on(executor: Executor, fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _add_to_server(servicer: EncoderServicer, server: grpc.aio.Server) -> None:
    """As `encoder_pb2_grpc.add_EncoderServicer_to_server`, but with Embed's own parser. The handlers
    come from the service's descriptor, so an RPC added to encoder.proto is mounted here too."""
    handlers = {}
    for method in encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].methods:
        assert not (method.client_streaming or method.server_streaming), f"{method.name} streams"
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=servicer.parse_embed if method.name == "Embed" else request.FromString,
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _shutting_down() -> Unavailable:
    return Unavailable("the encoder is shutting down; retry, on another replica if there is one")


def _no_wait(job: object) -> float:
    """Text batches wait for no company: a lookup costs less than any wait."""
    return 0.0


def _rows(response: encoder_pb2.EmbedResponse) -> tensor_pb2.Tensor | tensor_pb2.SharedTensor:
    return response.shared_embeddings if response.HasField("shared_embeddings") else response.embeddings


def _spec_from_pb(request: encoder_pb2.EmbedRequest) -> EmbedSpec:
    """The call as the request builder takes it. Fails only where an enum cannot be mapped."""
    source = request.WhichOneof("input")
    inputs = {
        "text": lambda: TextPrompt(request.text),
        "token_ids": lambda: request.token_ids.ids,
        "image": lambda: ImageBytes(request.image.data),
    }
    return EmbedSpec(
        input=inputs[source]() if source else None,
        add_special_tokens=request.add_special_tokens,
        request_id=request.request_id,
        pooling=_pooling(request.pooling),
        output_dtype=_output_dtype(request.output_dtype),
    )


def _pooling(pooling: int) -> Pooling | None:
    """None = the server's configured pooling."""
    if pooling == encoder_pb2.POOLING_UNSPECIFIED:
        return None
    if pooling not in _POOLINGS:
        raise InvalidArgument("pooling", f"unknown pooling {pooling}; use POOLING_NONE or POOLING_MEAN")
    return _POOLINGS[pooling]


def _output_dtype(dtype: int) -> torch.dtype | None:
    """None = the embedder's native dtype."""
    if dtype == tensor_pb2.DATA_TYPE_UNSPECIFIED:
        return None
    if dtype not in FLOAT_DATA_TYPES:
        name = tensor_pb2.DataType.Name(dtype) if dtype in tensor_pb2.DataType.values() else str(dtype)
        *others, last = (tensor_pb2.DataType.Name(d) for d in sorted(FLOAT_DATA_TYPES))
        raise InvalidArgument("output_dtype", f"{name} is not supported; use {', '.join(others)} or {last}")
    return tensors.to_torch_dtype(dtype, "output_dtype")


@dataclasses.dataclass
class _SegmentWatch:
    """The segment of one call offered shared memory, given back as soon as the call ends without its
    reply (its caller cancelled it: the handler cancelled, written or not yet) or cancelled after it,
    not when the lease runs out: else a caller cancelling its calls kept the pool leased, and others'
    replies went as bytes (40 cancelled calls held 2 of 8 segments for the 10 s lease). The decoder
    removes the name it asked for when its call is cancelled, but the batch may link it after that."""

    target: SharedTarget
    replied: bool = False  # the handler returned the reply naming it

    def call_ended(self, context: grpc.aio.ServicerContext) -> None:
        if not self.replied or context.cancelled():
            self.target.segments.abandon(self.target)
