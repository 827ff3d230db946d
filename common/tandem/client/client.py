"""Async clients for both services (used by the CLI, the tests and the benchmarks, and by callers).

Thin wrappers over the generated stubs, on a channel that sets the message-size limit, keepalive,
retries, TLS and token the servers expect (`channel.py`; its health, shared by both clients, in
`service_client.py`), and that build requests from plain Python values (`generate_requests.py`).
Errors surface as `grpc.aio.AioRpcError`; `grpc_status.rpc_status.aio.from_call` reads their
google.rpc details.

OpenTelemetry is optional: nothing here imports it at load. Without a `telemetry` argument a client
takes the process's own when the `OTEL_*` environment asks for an exporter (`client_telemetry.py`),
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
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from . import semconv
from .channel import DEFAULT_MAX_MESSAGE_BYTES
from .client_telemetry import CallDuration, call_attributes, telemetry_from_environ
from .generate_requests import (
    ChatPart,
    ChatTurn,
    EncoderPart,
    ImageRows,
    Segment,
    chat_prompt,
    prompt_segments,
    set_options,
    structured_output,
)
from .observed_stream import ObservedStream, StreamObserver
from .pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc, tensor_pb2
from .security import PLAINTEXT, ChannelSecurity
from .service_client import ServiceClient
from .status import error_type

if TYPE_CHECKING:  # OpenTelemetry is optional: a caller that passes telemetry has it installed
    from .telemetry import Telemetry

# The wheel's API (docs/API.md): the clients, and what their calls are built from, importable from here.
__all__ = [
    "ChannelSecurity",
    "ChatPart",
    "ChatTurn",
    "DecoderClient",
    "EncoderClient",
    "EncoderPart",
    "ImageRows",
    "Segment",
    "chat_prompt",
    "prompt_segments",
    "structured_output",
    "telemetry_from_environ",
]


class DecoderClient(ServiceClient):
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
            set_options(request, max_new_tokens, temperature, seed, stopping_and_output)

        def start() -> grpc.aio.UnaryStreamCall:
            return self.stub.Generate(request, timeout=timeout)

        observers: list[StreamObserver] = []
        if self._metrics is not None:  # timed from before the call starts, as the span is
            attributes = call_attributes(semconv.OPERATION_TEXT_COMPLETION, request.model)
            observers.append(CallDuration(self._metrics, attributes))
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
        set_options(request, max_new_tokens, temperature, seed, stopping_and_output)
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
                call_attributes(semconv.OPERATION_TEXT_COMPLETION, ""),
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


class EncoderClient(ServiceClient):
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
        attributes = call_attributes(semconv.OPERATION_EMBEDDINGS, "")
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
