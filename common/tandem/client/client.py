"""Async clients for both services (used by the CLI, the tests and the benchmarks, and by callers).

Thin wrappers over the generated stubs, on a channel that sets the message-size limit, keepalive,
retries, TLS and token the servers expect (`channel.py`), and that build requests from plain Python
values. Errors surface as `grpc.aio.AioRpcError`; `grpc_status.rpc_status.aio.from_call` reads
their google.rpc details.

OpenTelemetry is optional: nothing here imports it at load. Without a `telemetry` argument a client
takes the process's own when the `OTEL_*` environment asks for an exporter (`telemetry_from_environ`),
as the services do; with tracing on, each Generate and Embed gets a gen_ai client span
(`tandem.client.telemetry.client_spans`) over the OpenTelemetry gRPC client span, and carries W3C trace
context, so the servers' spans join the caller's trace. With metrics on, Generate and Embed record
`gen_ai.client.operation.duration`, and Embed and `generate_text` `gen_ai.client.token.usage` (a raw
Generate stream's usage is in its Finished event, which only its reader sees). Without telemetry the
channel and the calls are plain gRPC.

An address may name several servers (`host:port,host:port` or `dns:///name:port`): the channel then
balances over them (`tandem.client.channel`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import semconv
from .addresses import server_of
from .channel import DEFAULT_MAX_MESSAGE_BYTES, open_channel
from .errors import InvalidArgument
from .observed_stream import ObservedStream, StreamObserver
from .pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc, tensor_pb2
from .security import PLAINTEXT, ChannelSecurity
from .status import error_type

if TYPE_CHECKING:  # OpenTelemetry is optional: a caller that passes telemetry has it installed
    from .telemetry import ClientMetrics, Telemetry
    from .telemetry.client_spans import ClientSpans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageRows:
    """An image's rows from the encoder (`EncoderClient.embed_image`), as a chat message part: the
    model's chat template places them where it puts an image."""

    rows: tensor_pb2.Tensor  # [n, hidden_size], the image's whole span


@dataclass(frozen=True)
class EncoderPart:
    """An input whose rows the decoder fetches from its own encoder (a decoder started with --encoder:
    GetModelInfo.accepts_encoder_parts), so they never pass through the caller. Exactly one field is
    set; in a chat an image is placed by the model's template, as ImageRows are."""

    image: bytes | None = None  # PNG, JPEG, WebP or GIF bytes
    text: str | None = None
    token_ids: Sequence[int] | None = None

    def to_pb(self) -> encoder_pb2.EncoderInput:
        given = [value is not None for value in (self.image, self.text, self.token_ids)]
        if sum(given) != 1:
            raise ValueError("an EncoderPart holds exactly one of image, text or token_ids")
        if self.image is not None:
            return encoder_pb2.EncoderInput(image=encoder_pb2.Image(data=self.image))
        if self.text is not None:
            return encoder_pb2.EncoderInput(text=self.text)
        return encoder_pb2.EncoderInput(token_ids=tensor_pb2.TokenIds(ids=list(self.token_ids or ())))


# text, token IDs, packed embeddings, or an input for the decoder's encoder
Segment = str | Sequence[int] | tensor_pb2.Tensor | EncoderPart
ChatPart = Segment | ImageRows
# {"role": "user", "content": "..." or [parts] (None, absent or [] is empty text), optionally "name": "alice"
ChatTurn = Mapping[str, str | Sequence[ChatPart] | None]


def prompt_segments(parts: Sequence[Segment]) -> list[decoder_pb2.PromptSegment]:
    segments = []
    for part in parts:
        if isinstance(part, str):
            segments.append(decoder_pb2.PromptSegment(text=part))
        elif isinstance(part, tensor_pb2.Tensor):
            segments.append(decoder_pb2.PromptSegment(embeddings=part))
        elif isinstance(part, EncoderPart):
            segments.append(decoder_pb2.PromptSegment(encoder=part.to_pb()))
        else:
            segments.append(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=list(part))))
    return segments


def _turn_parts(content: object, i: int) -> Sequence[ChatPart]:
    """A turn's parts; None (or no content) and [] are one part of empty text. Only a list or tuple is
    parts: `content or []` took False, 0 and {} for empty text, and list() an OpenAI part object not in
    a list for its keys, where the gateway refuses both in these words."""
    if isinstance(content, str):
        return [content]
    if content is None:
        return [""]
    if not isinstance(content, (list, tuple)):
        raise InvalidArgument(
            f"messages[{i}].content",
            f"must be a string or a list of content parts, got {type(content).__name__}",
        )
    return content or [""]


def chat_prompt(
    messages: Sequence[ChatTurn],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    template_kwargs: dict[str, object] | None = None,
) -> decoder_pb2.ChatPrompt:
    """The ChatPrompt message for `messages` ({"role": ..., "content": str or a list of parts, and
    optionally "name": the participant's, which templates that print it read}). A content of [], None or
    none at all is a turn of empty text, as the gateway sends it (vLLM renders them so): the decoder
    refuses a turn of no parts."""
    prompt = decoder_pb2.ChatPrompt(add_generation_prompt=add_generation_prompt)
    for i, message in enumerate(messages):
        parts = _turn_parts(message.get("content"), i)
        turn = prompt.messages.add(role=str(message["role"]))
        if (name := message.get("name")) is not None:
            # Refused as the gateway refuses it: str() sent ["alice"] to the template as "['alice']".
            if not isinstance(name, str):
                raise InvalidArgument(f"messages[{i}].name", f"must be a string, got {type(name).__name__}")
            turn.name = name
        for part in parts:
            if isinstance(part, str):
                turn.content.add(text=part)
            elif isinstance(part, ImageRows):
                turn.content.add(image=part.rows)
            elif isinstance(part, tensor_pb2.Tensor):
                turn.content.add(embeddings=part)
            elif isinstance(part, EncoderPart):
                turn.content.add(encoder=part.to_pb())
            else:
                turn.content.add(token_ids=tensor_pb2.TokenIds(ids=list(part)))
    if chat_template is not None:
        prompt.chat_template = chat_template
    if template_kwargs:
        prompt.template_kwargs.update(template_kwargs)
    return prompt


def structured_output(
    *,
    json_schema: str | Mapping[str, object] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
) -> decoder_pb2.StructuredOutput:
    """A `structured=` value for generate / chat: exactly one of the arguments (a schema may be a dict)."""
    given = [json_schema is not None, json_object, regex is not None, choice is not None, grammar is not None]
    if sum(given) != 1:
        raise ValueError("give exactly one of json_schema, json_object, regex, choice or grammar")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return decoder_pb2.StructuredOutput(json_schema=text)
    if json_object:
        return decoder_pb2.StructuredOutput(json_object=True)
    if regex is not None:
        return decoder_pb2.StructuredOutput(regex=regex)
    if choice is not None:
        return decoder_pb2.StructuredOutput(choice=decoder_pb2.StructuredChoices(choices=list(choice)))
    return decoder_pb2.StructuredOutput(grammar=grammar)


def _set_options(
    request: decoder_pb2.GenerateRequest,
    max_new_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    stopping_and_output: dict[str, object],
) -> None:
    """Keyword arguments onto the request: the named ones, then stopping, output or the request's own
    fields (speculative_tokens, plain_text, adapter) by name."""
    if max_new_tokens is not None:
        request.stopping.max_new_tokens = max_new_tokens
    if temperature is not None:
        request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    for key, value in stopping_and_output.items():
        if key == "structured":  # a message field: structured_output() builds it
            request.structured.CopyFrom(value)  # type: ignore[arg-type]
            continue
        target: object = request
        if key in request.stopping.DESCRIPTOR.fields_by_name:
            target = request.stopping
        elif key in request.output.DESCRIPTOR.fields_by_name:
            target = request.output
        field = getattr(target, key)
        if hasattr(field, "extend"):
            field.extend(value)  # type: ignore[arg-type]
        else:
            setattr(target, key, value)


def _attributes(operation: str, model: str) -> dict[str, str]:
    attributes = {semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER}
    if model:
        attributes[semconv.GEN_AI_REQUEST_MODEL] = model
    return attributes


class _CallDuration:
    """A Generate call's `gen_ai.client.operation.duration`, recorded as its end is read (an
    `ObservedStream`'s observer: a command that shuts telemetry down right after keeps it)."""

    def __init__(self, metrics: ClientMetrics, attributes: dict[str, str]) -> None:
        self._metrics = metrics
        self._attributes = attributes
        self._start = time.monotonic()

    def on_response(self, response: decoder_pb2.GenerateResponse) -> None:
        pass

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        ok = code == grpc.StatusCode.OK
        attributes = self._attributes if ok else {**self._attributes, semconv.ERROR_TYPE: code.name}
        self._metrics.record(attributes, time.monotonic() - self._start)


def telemetry_from_environ(environ: Mapping[str, str] | None = None) -> Telemetry | None:
    """The process's client telemetry when `OTEL_*` asks for an exporter, else None.

    Built once per process and environment (OpenTelemetry's providers are per process too), and
    flushed at exit. None, with a warning, when OpenTelemetry is not installed.
    """
    variables = {
        k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("OTEL_")
    }
    return _telemetry_for(tuple(sorted(variables.items()))) if variables else None


@functools.cache
def _telemetry_for(variables: tuple[tuple[str, str], ...]) -> Telemetry | None:
    try:
        from .telemetry import TelemetrySettings, setup_telemetry
    except ImportError:
        log.warning("OTEL_* is set but OpenTelemetry is not installed: pip install 'tandem-client[otel]'")
        return None
    environ = dict(variables)
    settings = TelemetrySettings.from_environ("tandem-client", environ)
    if not settings.traces_exporters and not settings.metrics_exporters:
        return None
    return setup_telemetry("tandem-client", environ, owns_process=False)  # the application's propagator stays


# How a server answers a Watch past its bounds (common/health.py): UNIMPLEMENTED while it serves (so
# that gRPC's own health checking assumes it healthy), RESOURCE_EXHAUSTED while it does not.
_WATCH_REFUSED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)


class _Client:
    def __init__(
        self,
        address: str | Sequence[str],
        max_message_bytes: int,
        telemetry: Telemetry | None,
        security: ChannelSecurity,
        service: str,
        is_health_checked: bool,
    ) -> None:
        telemetry = telemetry if telemetry is not None else telemetry_from_environ()
        interceptors = telemetry.client_interceptors() if telemetry is not None else []
        self.channel = open_channel(
            address, max_message_bytes, security, interceptors, service, is_health_checked=is_health_checked
        )
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metrics: ClientMetrics | None = None
        self._spans: ClientSpans | None = None
        if telemetry is not None and telemetry.is_metrics:
            from .telemetry.metrics import ClientMetrics  # here: OpenTelemetry is optional

            self._metrics = ClientMetrics(telemetry.meter)
        if telemetry is not None and telemetry.is_tracing:
            from .telemetry.client_spans import ClientSpans

            self._spans = ClientSpans(telemetry.tracer, server_of(address))

    async def health(self, service: str = "", timeout: float = 5.0) -> int:
        """The server's health status for `service` ("" = the whole server)."""
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status

    async def wait_serving(self, timeout: float = 120.0) -> None:
        """Block until health says SERVING (the model is loaded and warmed up).

        A balanced channel picks only SERVING servers, so until one is, the check itself is
        UNAVAILABLE: asked again until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the server never became SERVING")
            try:
                stream = self._health.Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=remaining, wait_for_ready=True
                )
                async for reply in stream:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        stream.cancel()
                        return
            except grpc.aio.AioRpcError as error:
                if error.code() in _WATCH_REFUSED:
                    if await self._check_serving(deadline - time.monotonic()):
                        return
                elif error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def _check_serving(self, remaining: float) -> bool:
        """Whether a Check says SERVING, for a server that refused this client's Watch (its places
        held from this address: health.py). Check is never refused; a server without health at all
        answers it UNIMPLEMENTED too, raised."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=max(remaining, 0.001), wait_for_ready=True
            )
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class DecoderClient(_Client):
    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50052",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        telemetry: Telemetry | None = None,
        security: ChannelSecurity = PLAINTEXT,
        is_health_checked: bool = True,
    ):
        """`is_health_checked`: over several servers, each used only while its health Watch says
        SERVING; False: balanced over all of them, watching none (see `open_channel`)."""
        super().__init__(
            address, max_message_bytes, telemetry, security, "tandem.v1.Decoder", is_health_checked
        )
        self.stub = decoder_pb2_grpc.DecoderStub(self.channel)

    def generate(
        self,
        prompt: Sequence[Segment] | decoder_pb2.GenerateRequest,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        **stopping_and_output: object,
    ) -> grpc.aio.UnaryStreamCall:
        """Start a Generate stream; iterate the returned call for GenerateResponse events."""
        if isinstance(prompt, decoder_pb2.GenerateRequest):
            request = prompt
        else:
            request = decoder_pb2.GenerateRequest(prompt=prompt_segments(prompt))
            _set_options(request, max_new_tokens, temperature, seed, stopping_and_output)

        def start() -> grpc.aio.UnaryStreamCall:
            return self.stub.Generate(request, timeout=timeout)

        observers: list[StreamObserver] = []
        if self._metrics is not None:  # timed from before the call starts, as the span is
            attributes = _attributes(semconv.OPERATION_TEXT_COMPLETION, request.model)
            observers.append(_CallDuration(self._metrics, attributes))
        if self._spans is None:
            call = start()
        else:
            call, span = self._spans.generate(request, start)
            observers.append(span)
        return ObservedStream(call, observers) if observers else call  # type: ignore[return-value]

    def chat(
        self,
        messages: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_kwargs: dict[str, object] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        **stopping_and_output: object,
    ) -> grpc.aio.UnaryStreamCall:
        """Start a chat stream: `messages` rendered with the model's chat template on the server.

        Each message is {"role": ..., "content": ...}; content is a string or a list of parts, each a
        string (text), a Tensor (embeddings, e.g. the encoder's output), ImageRows, an EncoderPart (an
        input the decoder's own encoder embeds) or a list of token IDs.
        """
        request = decoder_pb2.GenerateRequest(
            chat=chat_prompt(messages, add_generation_prompt, chat_template, template_kwargs)
        )
        _set_options(request, max_new_tokens, temperature, seed, stopping_and_output)
        return self.generate(request, timeout=timeout)

    async def generate_text(
        self, prompt: Sequence[Segment] | decoder_pb2.GenerateRequest, **kwargs: object
    ) -> tuple[str, decoder_pb2.Finished]:
        """Convenience: the whole text and the Finished event (whose usage goes to the client metrics)."""
        return await self._collect(self.generate(prompt, **kwargs))  # type: ignore[arg-type]

    async def chat_text(
        self, messages: Sequence[ChatTurn], **kwargs: object
    ) -> tuple[str, decoder_pb2.Finished]:
        """Convenience: the whole reply and the Finished event, as generate_text."""
        return await self._collect(self.chat(messages, **kwargs))  # type: ignore[arg-type]

    async def _collect(self, call: grpc.aio.UnaryStreamCall) -> tuple[str, decoder_pb2.Finished]:
        text, finished = [], None
        async for response in call:
            if response.HasField("delta"):
                text.append(response.delta.text)
            elif response.HasField("finished"):
                finished = response.finished
        assert finished is not None
        if self._metrics is not None:
            self._metrics.record_usage(
                _attributes(semconv.OPERATION_TEXT_COMPLETION, ""),
                finished.usage.input_tokens,
                finished.usage.output_tokens,
            )
        return "".join(text), finished

    async def tokenize(self, texts: Sequence[str], timeout: float = 10.0) -> list[list[int]]:
        reply = await self.stub.Tokenize(
            decoder_pb2.DecoderTokenizeRequest(texts=list(texts)), timeout=timeout
        )
        return [list(t.ids) for t in reply.tokens]

    async def model_info(self, timeout: float = 10.0) -> decoder_pb2.DecoderGetModelInfoResponse:
        return await self.stub.GetModelInfo(decoder_pb2.DecoderGetModelInfoRequest(), timeout=timeout)

    async def load_adapter(self, name: str, path: str, timeout: float = 60.0) -> decoder_pb2.AdapterInfo:
        """Load the PEFT adapter at `path`, a directory inside the server's --lora-root and relative
        to it, as `name` (then generate(..., adapter=name) uses it)."""
        request = decoder_pb2.LoadAdapterRequest(name=name, path=path)
        return (await self.stub.LoadAdapter(request, timeout=timeout)).adapter

    async def unload_adapter(self, name: str, timeout: float = 10.0) -> int:
        """Stop serving adapter `name`; how many requests still run with it (they finish with it)."""
        request = decoder_pb2.UnloadAdapterRequest(name=name)
        return (await self.stub.UnloadAdapter(request, timeout=timeout)).running_requests

    async def list_adapters(self, timeout: float = 10.0) -> list[decoder_pb2.AdapterInfo]:
        reply = await self.stub.ListAdapters(decoder_pb2.ListAdaptersRequest(), timeout=timeout)
        return list(reply.adapters)


class EncoderClient(_Client):
    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50051",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        telemetry: Telemetry | None = None,
        security: ChannelSecurity = PLAINTEXT,
        is_health_checked: bool = True,
    ):
        """`is_health_checked`: over several servers, each used only while its health Watch says
        SERVING; False: balanced over all of them, watching none (see `open_channel`)."""
        super().__init__(
            address, max_message_bytes, telemetry, security, "tandem.v1.Encoder", is_health_checked
        )
        self.stub = encoder_pb2_grpc.EncoderStub(self.channel)

    async def embed(
        self,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        output_dtype: int = tensor_pb2.DATA_TYPE_UNSPECIFIED,
        timeout: float = 30.0,
        pooling: int = encoder_pb2.POOLING_UNSPECIFIED,
        image: bytes | None = None,
    ) -> encoder_pb2.EmbedResponse:
        """Embeds one of `text`, `token_ids` or `image` (PNG, JPEG, WebP or GIF bytes)."""
        request = encoder_pb2.EmbedRequest(output_dtype=output_dtype, pooling=pooling)
        if text is not None:
            request.text = text
        if token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        if image is not None:
            request.image.data = image
        if self._spans is not None:
            return await self._spans.embed(request, lambda: self._embed(request, timeout))
        return await self._embed(request, timeout)

    async def embed_image(self, image: bytes, timeout: float = 60.0) -> ImageRows:
        """An image's rows, ready to be a chat message part."""
        return ImageRows((await self.embed(image=image, timeout=timeout)).embeddings)

    async def _embed(self, request: encoder_pb2.EmbedRequest, timeout: float) -> encoder_pb2.EmbedResponse:
        if self._metrics is None:
            return await self.stub.Embed(request, timeout=timeout)
        attributes = _attributes(semconv.OPERATION_EMBEDDINGS, "")
        start = time.monotonic()
        try:
            response = await self.stub.Embed(request, timeout=timeout)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            self._metrics.record(
                {**attributes, semconv.ERROR_TYPE: error_type(exc)}, time.monotonic() - start
            )
            raise
        self._metrics.record(attributes, time.monotonic() - start)
        self._metrics.record_usage(attributes, response.usage.input_tokens, None)
        return response
