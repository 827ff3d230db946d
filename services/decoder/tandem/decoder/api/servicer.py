"""`tandem.v1.Decoder`: convert, validate, delegate. No scheduling or tensor math lives here.

With an encoder (`encoder_parts.py`), a call's `encoder` parts start fetching as soon as it is
converted and passed by the build's rules that read no position (its values, each part's shape, the
prompt's sizes against the context: the engine's `check_spec`, run again when the request is built),
and whatever ends the call cancels those still running.

With telemetry on, each Generate gets a `text_completion {model}` span (a child of the gRPC server
span) and its metrics; the engine's per-request timeline becomes span events once the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from tandem.client import telemetry as otel
from tandem.client.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, tensor_pb2
from tandem.client.telemetry.server_spans import is_past_deadline
from tandem.common.model_name import check_adapter_name, check_model
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import EmbeddingPrompt
from tandem.common.wire_limits import check_tokenize_texts
from tandem.decoder.api import protocol
from tandem.decoder.api.caller import caller_of
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.api.engine_metrics import observe_engine
from tandem.decoder.api.request_width import check_width
from tandem.decoder.api.stream_limit import StreamLimit
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Accepted, Delta, Event, Failed, Finished
from tandem.decoder.engine.outputs.token_bytes import TokenBytes
from tandem.decoder.models.adapter_root import ROOT_FLAG


class DecoderServicer(decoder_pb2_grpc.DecoderServicer):
    def __init__(
        self,
        model_name: str,
        max_message_bytes: int,
        world_size: int = 1,
        engine: Engine | None = None,
        telemetry: otel.Telemetry | None = None,
        max_streams_per_connection: int | None = None,  # None: no bound (stream_limit.py)
        identify_by_token: bool = False,  # bearer tokens are on: a caller is its token (caller.py)
        max_streams_per_token: int | None = None,  # with identify_by_token; None: no bound
        encoder_parts: EncoderParts | None = None,  # None: `encoder` parts are refused
        # The checkpoint's token table sample GetModelInfo reports (`token_table.py`); None: unset.
        token_table_sample: encoder_pb2.TokenTableSample | None = None,
        # And its later weights' (`token_table.py`); empty: none reported.
        weight_samples: Sequence[decoder_pb2.WeightSample] = (),
    ) -> None:
        self.model_name = model_name
        self.max_message_bytes = max_message_bytes
        self.world_size = world_size
        self.engine = engine  # None while loading: every RPC answers UNAVAILABLE
        self.encoder_parts = encoder_parts
        self.token_table_sample = token_table_sample
        self.weight_samples = weight_samples
        self.streams = StreamLimit(max_streams_per_connection)
        self.identify_by_token = identify_by_token
        self.token_streams = StreamLimit(max_streams_per_token, "bearer token", "--max-streams-per-token")
        # An embedding tensor can never be larger than a message, so the element cap follows from it;
        # rows are [n, hidden_size], so more than two dimensions are refused before one is read. Fewer
        # reach the engine, whose refusal names the hidden size.
        self.tensor_limits = tensors.TensorLimits(max_elements=max_message_bytes // 2, max_rank=2)
        # None when telemetry is off: Generate then records nothing at all.
        self._telemetry = telemetry if telemetry is not None and telemetry.is_enabled else None
        self._metrics = otel.ServerMetrics(telemetry.meter) if self._telemetry is not None else None
        if self._telemetry is not None:
            observe_engine(self._telemetry.meter, lambda: self.engine)

    def _healthy_engine(self) -> Engine:
        if self.engine is None or not self.engine.is_healthy:
            raise Unavailable("the decoder is loading, draining or has failed; retry later")
        return self.engine

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        received = time.monotonic()  # its metrics count from here: building may queue (a grammar's)
        op = None
        if self._telemetry is not None and self._metrics is not None:
            op = otel.ServerOperation(
                self._telemetry, self._metrics, otel.OPERATION_TEXT_COMPLETION, self.model_name
            )
        is_finished = False
        fetches: list[asyncio.Task] = []
        try:
            caller = caller_of(context.peer(), context.invocation_metadata(), self.identify_by_token)
            with self.streams.open(context.peer()), self._token_streams(caller):
                engine = self._healthy_engine()
                check_model(request.model, self.model_name)
                check_width(request, engine.max_model_len)  # counts only: nothing converted yet
                spec = protocol.spec_from_pb(request, self.tensor_limits, context.time_remaining())
                spec = dataclasses.replace(
                    spec, caller=caller, arrival_time=received, max_reply_bytes=self.max_message_bytes
                )
                if self.encoder_parts is not None:
                    spec, fetches = self.encoder_parts.start(
                        spec,
                        context.invocation_metadata(),
                        context.time_remaining(),
                        # The build's rules that read no position, before the encoder is asked for rows.
                        engine.check_spec,
                    )
                num_embedding_positions = _num_embedding_positions(spec)
                if op is not None:
                    op.set(_request_attributes(spec, num_embedding_positions, self.world_size))
                # Leaving this loop for any reason (client cancel, deadline, error) aborts the request.
                async for event in engine.stream(spec):
                    if isinstance(event, Failed):
                        raise event.error
                    if op is not None and not isinstance(event, Delta):
                        self._observe(op, event, num_embedding_positions)
                    is_finished = isinstance(event, Finished)
                    yield await _to_pb(event, engine.token_bytes)
        except BaseException as exc:
            # A cancel after Finished went out (the client leaving as the stream ends) is no failure.
            if op is not None and not is_finished:
                op.fail(_as_the_caller_sees(exc, context))
            raise
        finally:
            for fetch in fetches:  # the request is admitted or failed: nothing waits for these now
                fetch.cancel()
            if op is not None:
                op.end()

    def _token_streams(self, caller: str) -> contextlib.AbstractContextManager[None]:
        """The token's share of open streams; without tokens the caller is the connection, already
        bounded."""
        return self.token_streams.open(caller) if self.identify_by_token else contextlib.nullcontext()

    def _observe(self, op: otel.ServerOperation, event: Event, num_embedding_positions: int) -> None:
        """Accepted and Finished, as span attributes, span events and metric points."""
        assert self._metrics is not None
        if isinstance(event, Accepted):
            op.is_accepted = True
            op.set({otel.GEN_AI_RESPONSE_ID: event.request_id})
        elif isinstance(event, Finished):
            op.set(
                {
                    otel.GEN_AI_RESPONSE_MODEL: self.model_name,
                    otel.GEN_AI_RESPONSE_FINISH_REASONS: (event.reason.value,),
                    otel.GEN_AI_USAGE_INPUT_TOKENS: event.prompt_tokens,
                    otel.GEN_AI_USAGE_OUTPUT_TOKENS: event.output_tokens,
                    otel.TANDEM_USAGE_CACHED_TOKENS: event.cached_tokens,
                }
            )
            if event.output_tokens > 0:
                op.set({otel.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: event.time_to_first_token_s})
            op.add_timeline((e.name, e.time, e.attributes) for e in event.timeline)
            m, attributes = self._metrics, op.attributes
            if event.output_tokens > 0:
                m.time_to_first_token.record(event.time_to_first_token_s, attributes)
            if event.output_tokens > 1:
                decode_s = event.total_time_s - event.time_to_first_token_s
                m.time_per_output_token.record(decode_s / (event.output_tokens - 1), attributes)
            for kind, count in zip(
                otel.TOKEN_KINDS,
                (event.prompt_tokens - num_embedding_positions, num_embedding_positions, event.output_tokens),
                strict=True,
            ):
                if count:
                    m.tokens.add(count, {**attributes, otel.TANDEM_TOKEN_KIND: kind})

    async def Tokenize(
        self, request: decoder_pb2.DecoderTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderTokenizeResponse:
        engine = self._healthy_engine()
        texts = list(request.texts)
        check_tokenize_texts(texts, engine.max_token_chars, engine.max_model_len, "max_model_len")
        caller = caller_of(context.peer(), context.invocation_metadata(), self.identify_by_token)
        token_ids = await engine.tokenize(texts, request.add_special_tokens, caller)
        return decoder_pb2.DecoderTokenizeResponse(tokens=[tensor_pb2.TokenIds(ids=ids) for ids in token_ids])

    async def GetModelInfo(
        self, request: decoder_pb2.DecoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderGetModelInfoResponse:
        engine = self._healthy_engine()
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
            has_chat_template=engine.chat_template.source is not None,
            image_placeholder=engine.chat_template.image_placeholder or "",
            adapters=[protocol.adapter_to_pb(a) for a in engine.adapters],
            max_loras=engine.config.max_loras if engine.config.enable_lora else 0,
            max_lora_rank=engine.config.max_lora_rank if engine.config.enable_lora else 0,
            accepts_encoder_parts=self.encoder_parts is not None,
            token_table_sample=self.token_table_sample,
            weight_samples=self.weight_samples,
        )

    async def LoadAdapter(
        self, request: decoder_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.LoadAdapterResponse:
        engine = self._healthy_engine()
        check_adapter_name(request.name)
        if request.name == self.model_name:  # the OpenAI front's `model` could not tell them apart
            raise InvalidArgument("name", f"{request.name!r} is the base model's own name")
        root = engine.adapter_root
        if root is None:
            if not engine.config.enable_lora:
                raise FailedPrecondition("name", "this server runs without LoRA: start it with --enable-lora")
            # vLLM loads no adapter at run time unless told to: a path a caller names is opened only
            # inside the directory the operator set aside for it.
            raise FailedPrecondition(
                "path", f"this server loads adapters at start only (--lora): start it with {ROOT_FLAG} DIR"
            )
        directory = await asyncio.to_thread(root.find, request.path)  # file system calls, off the loop
        # Read from the root's descriptor along the path find resolved: a symlink on it, or another file
        # than find found, by the time it is read was swapped in since (it may lead out).
        adapter = await engine.load_adapter(
            request.name, directory.path, directory.shown, found=directory.found
        )
        return decoder_pb2.LoadAdapterResponse(adapter=protocol.adapter_to_pb(adapter))

    async def UnloadAdapter(
        self, request: decoder_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.UnloadAdapterResponse:
        check_adapter_name(request.name)  # as LoadAdapter: a 10,000-character name was echoed as not loaded
        running = self._healthy_engine().unload_adapter(request.name)
        return decoder_pb2.UnloadAdapterResponse(running_requests=running)

    async def ListAdapters(
        self, request: decoder_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.ListAdaptersResponse:
        adapters = self._healthy_engine().adapters
        return decoder_pb2.ListAdaptersResponse(adapters=[protocol.adapter_to_pb(a) for a in adapters])


async def _to_pb(event: Event, token_bytes: TokenBytes) -> decoder_pb2.GenerateResponse:
    """`event`'s reply. A delta carrying prompt logprobs is built on a worker thread: 8,192 positions
    with 20 alternatives each took 205 ms (115 ms live at 5,800), during which this loop served no
    other stream and no health check. Awaited here, so the stream's replies keep their order and a
    cancel still ends the handler at once (the thread's work is then dropped). The thread takes the
    GIL in turns (5 ms switches), so the loop runs in between: a health check's worst wait around
    that delta, live at 5,800 positions, was 173 ms built here and 61-71 ms on the thread. Every
    other event is small (a step's tokens): built here, where a thread's hand-off costs more."""
    if isinstance(event, Delta) and event.prompt_logprobs:
        return await asyncio.to_thread(protocol.event_to_pb, event, token_bytes)
    return protocol.event_to_pb(event, token_bytes)


def _as_the_caller_sees(exc: BaseException, context: grpc.aio.ServicerContext) -> BaseException:
    """grpc cancels a stream whose deadline passed: its caller sees DEADLINE_EXCEEDED, and so does
    its span (it said CANCELLED). The handler ends by CancelledError, or by GeneratorExit when grpc
    closes the stream between two replies (3 of 8 runs on a loaded CI box). Whether the deadline cut it
    is the server span's rule (`is_past_deadline`), so the two spans agree."""
    cut = isinstance(exc, (asyncio.CancelledError, GeneratorExit))
    if cut and is_past_deadline(context):
        return DeadlineExceeded("the call's deadline passed")
    return exc


def _num_embedding_positions(spec: GenerateSpec) -> int:
    parts = [*spec.prompt, *(p for m in spec.chat.messages for p in m.content)] if spec.chat else spec.prompt
    return sum(part.rows.shape[0] for part in parts if isinstance(part, EmbeddingPrompt))


def _request_attributes(
    spec: GenerateSpec, num_embedding_positions: int, world_size: int
) -> dict[str, object]:
    sampling, stopping = spec.sampling, spec.stopping
    attributes: dict[str, object] = {
        otel.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
        otel.GEN_AI_REQUEST_TOP_P: sampling.top_p,
        otel.GEN_AI_REQUEST_TOP_K: sampling.top_k,
        otel.TANDEM_PROMPT_EMBEDDING_POSITIONS: num_embedding_positions,
        otel.TANDEM_WORLD_SIZE: world_size,
    }
    # No bound asked (cap_to_context, max_new_tokens unset): none recorded, as the client's span does.
    if not (spec.cap_max_new_tokens and stopping.max_new_tokens == protocol.NO_BOUND):
        attributes[otel.GEN_AI_REQUEST_MAX_TOKENS] = stopping.max_new_tokens
    if sampling.seed is not None:
        attributes[otel.GEN_AI_REQUEST_SEED] = sampling.seed
    if stopping.stop:
        attributes[otel.GEN_AI_REQUEST_STOP_SEQUENCES] = list(stopping.stop)
    return attributes
