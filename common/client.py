"""Async clients for both services (used by the CLI, the tests and the benchmarks).

Thin wrappers over the generated stubs that set the message-size limit and keepalive the servers
expect, and build requests from plain Python values. Errors surface as `grpc.aio.AioRpcError`;
`grpc_status.rpc_status.aio.from_call` reads their google.rpc details.

Given a `Telemetry` with tracing on, the channel gets the OpenTelemetry client interceptors: each
call gets a client span and carries W3C trace context, so the servers' spans join the caller's trace.
With metrics on, Generate and Embed record `gen_ai.client.operation.duration`, and Embed and
`generate_text` `gen_ai.client.token.usage` (a raw Generate stream's usage is in its Finished event,
which only its reader sees). Without telemetry the channel and the calls are plain gRPC.

Idempotent unary calls (Embed, Tokenize, GetModelInfo, health Check) are retried by gRPC itself
when they end UNAVAILABLE (a server restarting, a connection reset): `RETRY_SERVICE_CONFIG`, with
throttling so that a dead server does not get a retry storm. Generate is never retried: a stream
that already produced tokens cannot be replayed, and the caller decides what a retry means.

`ChannelSecurity` turns on TLS (a CA to trust, optionally a client certificate for mutual TLS) and
a bearer token, sent as `authorization: Bearer <token>` on every call (see `common.auth`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import telemetry as otel
from common.auth import bearer_token_interceptors, read_token
from common.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc, tensor_pb2
from common.server import DEFAULT_MAX_MESSAGE_BYTES, channel_options

Segment = str | Sequence[int] | tensor_pb2.Tensor  # text, token IDs, or packed embeddings

_IDEMPOTENT_METHODS = [
    {"service": "tandem.v1.Encoder", "method": "Embed"},
    {"service": "tandem.v1.Encoder", "method": "Tokenize"},
    {"service": "tandem.v1.Encoder", "method": "GetModelInfo"},
    {"service": "tandem.v1.Decoder", "method": "Tokenize"},
    {"service": "tandem.v1.Decoder", "method": "GetModelInfo"},
    {"service": "grpc.health.v1.Health", "method": "Check"},
]
# Up to 5 attempts within the call's own deadline, about 1.5 s of backoff in all. Throttling: each
# failed attempt costs a token, each success earns 0.1, and retries stop below half of maxTokens.
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": _IDEMPOTENT_METHODS,
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
        "retryThrottling": {"maxTokens": 20, "tokenRatio": 0.1},
    }
)


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a server that uses TLS and/or bearer tokens. The default is plaintext."""

    is_tls: bool = False  # TLS even without the PEM fields (then the system's trusted roots).
    root_certificates: bytes | None = None  # PEM CA(s) trusted for the server certificate.
    certificate_chain: bytes | None = None  # mutual TLS: this client's certificate, PEM.
    private_key: bytes | None = field(default=None, repr=False)  # mutual TLS: its key, PEM.
    token: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer <token>`.

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and the other way round")

    @property
    def uses_tls(self) -> bool:
        return self.is_tls or any(
            v is not None for v in (self.root_certificates, self.certificate_chain, self.private_key)
        )

    @classmethod
    def from_files(
        cls,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token_file: Path | None = None,
        is_tls: bool = False,
    ) -> ChannelSecurity:
        """From PEM files and a token file (its first token), as the CLI flags name them."""

        def read(path: Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(
            is_tls=is_tls,
            root_certificates=read(ca),
            certificate_chain=read(cert),
            private_key=read(key),
            token=None if token_file is None else read_token(token_file),
        )


PLAINTEXT = ChannelSecurity()


def client_channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """`channel_options` plus the retry policy for idempotent calls."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", RETRY_SERVICE_CONFIG),
        # While a server is down the channel waits longer and longer between reconnects (gRPC's
        # default grows to 120 s); a restarted server is found again within 5 s.
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


def open_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    security: ChannelSecurity = PLAINTEXT,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel to one of our services: size limits, keepalive, retries, TLS and token as asked."""
    options = client_channel_options(max_message_bytes)
    chain = [*interceptors, *(bearer_token_interceptors(security.token) if security.token else [])] or None
    if not security.uses_tls:
        return grpc.aio.insecure_channel(address, options=options, interceptors=chain)
    credentials = grpc.ssl_channel_credentials(
        security.root_certificates, security.private_key, security.certificate_chain
    )
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=chain)


def prompt_segments(parts: Sequence[Segment]) -> list[decoder_pb2.PromptSegment]:
    segments = []
    for part in parts:
        if isinstance(part, str):
            segments.append(decoder_pb2.PromptSegment(text=part))
        elif isinstance(part, tensor_pb2.Tensor):
            segments.append(decoder_pb2.PromptSegment(embeddings=part))
        else:
            segments.append(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=list(part))))
    return segments


def _attributes(operation: str, model: str) -> dict[str, str]:
    attributes = {otel.GEN_AI_OPERATION_NAME: operation, otel.GEN_AI_PROVIDER_NAME: otel.PROVIDER}
    if model:
        attributes[otel.GEN_AI_REQUEST_MODEL] = model
    return attributes


def _time_call(call: grpc.aio.Call, metrics: otel.ClientMetrics, attributes: dict[str, str]) -> None:
    """Record the call's duration when it ends, by a done callback: the stream stays the plain call,
    so nothing is added per message."""
    start = time.monotonic()
    loop = asyncio.get_running_loop()

    def done(finished: grpc.aio.Call) -> None:
        duration_s = time.monotonic() - start

        async def record() -> None:
            code = await finished.code()
            ok = code == grpc.StatusCode.OK
            metrics.record(attributes if ok else {**attributes, otel.ERROR_TYPE: code.name}, duration_s)

        _pending.add(task := loop.create_task(record()))
        task.add_done_callback(_pending.discard)

    call.add_done_callback(done)


_pending: set[asyncio.Task] = set()  # recording tasks, held until done so they are not collected


class _Client:
    def __init__(
        self,
        address: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        telemetry: otel.Telemetry | None = None,
        security: ChannelSecurity = PLAINTEXT,
    ) -> None:
        interceptors = telemetry.client_interceptors() if telemetry is not None else []
        self.channel = open_channel(address, max_message_bytes, security, interceptors)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metrics = (
            otel.ClientMetrics(telemetry.meter) if telemetry is not None and telemetry.is_metrics else None
        )

    async def health(self, service: str = "", timeout: float = 5.0) -> int:
        """The server's health status for `service` ("" = the whole server)."""
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status

    async def wait_serving(self, timeout: float = 120.0) -> None:
        """Block until health says SERVING (the model is loaded and warmed up)."""
        stream = self._health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        async for reply in stream:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                stream.cancel()
                return
        raise TimeoutError("the server never became SERVING")

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class DecoderClient(_Client):
    def __init__(
        self,
        address: str = "127.0.0.1:50052",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        telemetry: otel.Telemetry | None = None,
        security: ChannelSecurity = PLAINTEXT,
    ):
        super().__init__(address, max_message_bytes, telemetry, security)
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
            if max_new_tokens is not None:
                request.stopping.max_new_tokens = max_new_tokens
            if temperature is not None:
                request.sampling.temperature = temperature
            if seed is not None:
                request.sampling.seed = seed
            for key, value in stopping_and_output.items():
                target = (
                    request.stopping if key in request.stopping.DESCRIPTOR.fields_by_name else request.output
                )
                field = getattr(target, key)
                if hasattr(field, "extend"):
                    field.extend(value)  # type: ignore[arg-type]
                else:
                    setattr(target, key, value)
        call = self.stub.Generate(request, timeout=timeout)
        if self._metrics is not None:
            _time_call(call, self._metrics, _attributes(otel.OPERATION_TEXT_COMPLETION, request.model))
        return call

    async def generate_text(
        self, prompt: Sequence[Segment], **kwargs: object
    ) -> tuple[str, decoder_pb2.Finished]:
        """Convenience: the whole text and the Finished event (whose usage goes to the client metrics)."""
        text, finished = [], None
        async for response in self.generate(prompt, **kwargs):  # type: ignore[arg-type]
            if response.HasField("delta"):
                text.append(response.delta.text)
            elif response.HasField("finished"):
                finished = response.finished
        assert finished is not None
        if self._metrics is not None:
            self._metrics.record_usage(
                _attributes(otel.OPERATION_TEXT_COMPLETION, ""),
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


class EncoderClient(_Client):
    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        telemetry: otel.Telemetry | None = None,
        security: ChannelSecurity = PLAINTEXT,
    ):
        super().__init__(address, max_message_bytes, telemetry, security)
        self.stub = encoder_pb2_grpc.EncoderStub(self.channel)

    async def embed(
        self,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        output_dtype: int = tensor_pb2.DATA_TYPE_UNSPECIFIED,
        timeout: float = 30.0,
    ) -> encoder_pb2.EmbedResponse:
        request = encoder_pb2.EmbedRequest(output_dtype=output_dtype)
        if text is not None:
            request.text = text
        if token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        if self._metrics is None:
            return await self.stub.Embed(request, timeout=timeout)
        attributes = _attributes(otel.OPERATION_EMBEDDINGS, "")
        start = time.monotonic()
        try:
            response = await self.stub.Embed(request, timeout=timeout)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            self._metrics.record(
                {**attributes, otel.ERROR_TYPE: otel.error_type(exc)}, time.monotonic() - start
            )
            raise
        self._metrics.record(attributes, time.monotonic() - start)
        self._metrics.record_usage(attributes, response.usage.input_tokens, None)
        return response
