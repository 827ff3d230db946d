"""The OpenAI-compatible HTTP front: aiohttp handlers that translate to the services' gRPC calls.

Thin by design: a body is parsed and converted (`requests.py`), the call goes to the decoder or the
encoder over the Python client's channels (balancing, TLS, retries), and its events come back as
OpenAI objects or server-sent events (`responses.py`); every limit on content is the services' own.
What the gateway itself guards: the bearer token (the services' token file; a caller's token travels
on with its calls, so the decoder's per-token bounds and fair sharing see each caller), the body's
size, open completions per caller (its token, else its address), and a caller that disconnects: its
handler is cancelled (aiohttp's handler cancellation), which cancels the gRPC call, which frees the
request's KV blocks. Without tokens every HTTP caller reaches the decoder over the gateway's one
connection: the decoder's --max-streams-per-connection then bounds the gateway as a whole.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from aiohttp import web

from tandem.client.client import DecoderClient, EncoderClient
from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.gateway import requests
from tandem.gateway.config import GatewayConfig
from tandem.gateway.errors import HttpError, from_grpc, from_invalid
from tandem.gateway.responses import Completion

log = logging.getLogger("tandem.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
UNAUTHENTICATED_PATHS = ("/health",)
# FINISH_REASON_ABORTED: the decoder drained (SIGTERM) before the answer ended; OpenAI has no such reason.
ABORTED = HttpError(503, "service_unavailable", "the server stopped before the answer ended; retry")
LARGE_BODY_BYTES = 1024 * 1024  # parsed and converted on a thread above this
BODY_BYTES = web.RequestKey("body_bytes", int)  # the body's size, once read


def error_response(error: HttpError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


class Gateway:
    def __init__(
        self, config: GatewayConfig, decoder: DecoderClient, encoder: EncoderClient, tracer: Any = None
    ) -> None:
        self.config = config
        self.decoder = decoder
        self.encoder = encoder
        self.tracer = tracer  # an OpenTelemetry tracer when tracing is on: one span per HTTP request
        self._streams: Counter[str] = Counter()  # open completions per caller
        self._model: str | None = None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self._errors, self._authenticate, self._trace],
        )
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        return app

    # -- middlewares ------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidArgument as error:
            return error_response(from_invalid(error))
        except grpc.aio.AioRpcError as error:
            return error_response(from_grpc(error))
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body is over {self.config.max_body_bytes} bytes (--max-body-bytes)"
            return error_response(HttpError(413, "invalid_request_error", message))
        except web.HTTPException as error:  # 404 / 405 from routing
            return error_response(HttpError(error.status, "invalid_request_error", error.reason))
        except UnicodeEncodeError:  # Python's JSON parser lets lone UTF-16 surrogates ("\ud800") through
            message = "holds a lone UTF-16 surrogate, which is not valid UTF-8 text"
            return error_response(HttpError(400, "invalid_request_error", f"body: {message}", "body"))
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the caller left: nothing to answer
        except Exception:  # a bug: an OpenAI-shaped 500, the traceback in our log only
            log.exception("%s %s failed", request.method, request.path)
            return error_response(HttpError(500, "server_error", "the gateway failed on this request"))

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        tokens = self.config.auth_tokens
        if tokens is not None and request.path not in UNAUTHENTICATED_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token not in tokens:
                return error_response(
                    HttpError(401, "authentication_error", "missing or unknown bearer token")
                )
        return await handler(request)

    @web.middleware
    async def _trace(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.tracer is None:
            return await handler(request)
        from opentelemetry import propagate, trace

        context = propagate.extract(dict(request.headers))
        name = f"{request.method} {request.path}"
        with self.tracer.start_as_current_span(name, context=context, kind=trace.SpanKind.SERVER) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            return response

    # -- endpoints --------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        try:
            serving = await self.decoder.health(timeout=2.0) == 1
        except grpc.aio.AioRpcError:
            serving = False
        return web.json_response(
            {"status": "ok" if serving else "unavailable"}, status=200 if serving else 503
        )

    async def models(self, request: web.Request) -> web.Response:
        info = await self.decoder.stub.GetModelInfo(
            decoder_pb2.DecoderGetModelInfoRequest(), metadata=self._metadata(request), timeout=10
        )
        card = {"id": info.model, "object": "model", "created": 0, "owned_by": "tandem"}
        # LoRA adapters as vLLM lists them: a model of their own, its parent the base model.
        adapters = [
            {
                "id": a.name,
                "object": "model",
                "created": 0,
                "owned_by": "tandem",
                "root": a.path,
                "parent": info.model,
            }  # fmt: skip
            for a in info.adapters
        ]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        requests.chat_request(body, None, images_pending=True)  # every other rule first: images cost calls
        images = await self._embed_images(request, requests.image_urls(body))
        generate = await _convert(request, lambda b: requests.chat_request(b, images), body)
        return await self._complete(request, body, "chat", generate)

    async def _embed_images(
        self, request: web.Request, found: dict[tuple[int, int], bytes]
    ) -> requests.ImageRowsByPart:
        """The encoder's rows for each image part, embedded concurrently (the encoder batches them)."""
        if not found:
            return {}
        metadata = self._metadata(request)

        async def rows(where: tuple[int, int], data: bytes) -> tuple[tuple[int, int], Any]:
            embed = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=data))
            try:
                reply = await self.encoder.stub.Embed(embed, metadata=metadata)
            except grpc.aio.AioRpcError as error:
                if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    i, j = where
                    raise InvalidArgument(f"messages[{i}].content[{j}].image_url", error.details()) from None
                raise
            return where, reply.embeddings

        return dict(await _all([rows(where, data) for where, data in found.items()]))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        generate = await _convert(request, requests.completion_request, body)
        return await self._complete(request, body, "text", generate)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await _json(request)
        calls = requests.embed_request(body)
        metadata = self._metadata(request)
        replies = await _all([self.encoder.stub.Embed(c, metadata=metadata) for c in calls])
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for i, reply in enumerate(replies):
            rows = np.frombuffer(reply.embeddings.data, dtype="<f4").reshape(list(reply.embeddings.shape))
            vector: Any = (
                rows[0] if rows.shape[0] == 1 and calls[i].pooling == encoder_pb2.POOLING_MEAN else rows
            )
            if as_base64:
                vector = base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()
            else:
                vector = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(r.usage.input_tokens for r in replies)
        model = body.get("model") or await self._model_name(request)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})

    # -- completions --------------------------------------------------------------------------------------

    async def _complete(
        self, request: web.Request, body: dict[str, Any], kind: str, generate: decoder_pb2.GenerateRequest
    ) -> web.StreamResponse:
        base = await self._model_name(request)
        model = body.get("model") or base
        if generate.model and generate.model != base:  # as in vLLM: a LoRA adapter, by its name
            generate.adapter, generate.model = generate.model, ""
        connection = _caller(request, self.config.auth_tokens is not None)
        if self._streams[connection] >= self.config.max_streams_per_caller:
            limit = self.config.max_streams_per_caller
            message = f"{limit} completions of this caller are open (--max-streams-per-caller)"
            return error_response(HttpError(429, "rate_limit_error", message, retry_after_s=1.0))
        generate.request_id = uuid.uuid4().hex
        if generate.ByteSize() > self.config.max_message_bytes:
            message = (
                f"the request is {generate.ByteSize()} bytes as a Generate call, over the services' "
                f"max_message_bytes {self.config.max_message_bytes}"
            )
            return error_response(HttpError(413, "invalid_request_error", message))
        stream = body.get("stream") is True
        with_logprobs = generate.output.logprobs
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        completion = Completion(kind, generate.request_id, model)
        self._streams[connection] += 1
        call = None
        try:
            call = self.decoder.stub.Generate(generate, metadata=self._metadata(request))
            events = call.__aiter__()
            first = await events.__anext__()  # a refusal arrives here, before any byte is written
            if not stream:
                await self._collect(first, events, completion, with_logprobs)
                if completion.aborted:
                    return error_response(ABORTED)
                return web.json_response(completion.whole(with_logprobs))
            return await self._stream(request, first, events, completion, with_logprobs, include_usage)
        finally:
            if call is not None:
                call.cancel()  # a no-op once the stream ended; frees the request if the caller left
            self._streams[connection] -= 1
            if not self._streams[connection]:
                del self._streams[connection]

    @staticmethod
    async def _collect(
        first: decoder_pb2.GenerateResponse, events: Any, completion: Completion, with_logprobs: bool
    ) -> None:
        response: decoder_pb2.GenerateResponse | None = first
        while response is not None:
            if response.HasField("delta"):
                completion.add(response.delta, with_logprobs)
            elif response.HasField("finished"):
                completion.finished = response.finished
            response = await anext(events, None)

    async def _stream(
        self,
        request: web.Request,
        first: decoder_pb2.GenerateResponse,
        events: Any,
        completion: Completion,
        with_logprobs: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        async def send(payload: dict[str, Any] | str) -> None:
            text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await response.write(f"data: {text}\n\n".encode())

        if completion.kind == "chat":
            await send(completion.chunk(None, False, first=True) | {"choices": [_opening(completion)]})
        event: decoder_pb2.GenerateResponse | None = first
        try:
            while event is not None:
                if event.HasField("delta") and with_logprobs:
                    await send(completion.chunk(event.delta, with_logprobs))
                elif event.HasField("delta") and event.delta.text:
                    await send(completion.text_chunk(event.delta.text))
                elif event.HasField("finished"):
                    completion.finished = event.finished
                event = await anext(events, None)
        except grpc.aio.AioRpcError as error:  # after the headers: the error goes in the stream
            await send(from_grpc(error).body())
        else:
            if completion.aborted:
                await send(ABORTED.body())
                await send("[DONE]")
                await response.write_eof()
                return response
            await send(completion.chunk(None, with_logprobs))
            if include_usage and completion.finished is not None:
                await send(completion.usage_chunk())
        await send("[DONE]")
        await response.write_eof()
        return response

    def _metadata(self, request: web.Request) -> tuple[tuple[str, str], ...] | None:
        """The caller's token, passed on when the gateway checks tokens (the services accept the same),
        unless the gateway has a token of its own for them."""
        if self.config.auth_tokens is None or self.config.upstream.token is not None:
            return None
        return (("authorization", request.headers["Authorization"]),)

    async def _model_name(self, request: web.Request) -> str:
        if self._model is None:
            info = await self.decoder.stub.GetModelInfo(
                decoder_pb2.DecoderGetModelInfoRequest(), metadata=self._metadata(request), timeout=10
            )
            self._model = info.model
        return self._model


async def _convert(
    request: web.Request, convert: Callable[[dict[str, Any]], Any], body: dict[str, Any]
) -> Any:
    """`convert(body)`, on a thread for a large body (base64 rows decode at about 1 GB/s)."""
    if request.get(BODY_BYTES, 0) < LARGE_BODY_BYTES:
        return convert(body)
    return await asyncio.to_thread(convert, body)


async def _all(awaitables: list[Any]) -> list[Any]:
    """Every result, in order; the first failure cancels the rest (no work left running for nobody)
    and is raised as it is (gRPC errors keep their status)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def _caller(request: web.Request, tokens_checked: bool) -> str:
    """Who is calling: a digest of its (checked) bearer token, else the peer's address. An unchecked
    token says nothing: a caller could send a new one with each request."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if tokens_checked and scheme.lower() == "bearer" and token:
        return "token:" + hashlib.blake2b(token.encode(), digest_size=16).hexdigest()
    return f"peer:{request.remote}"


def _opening(completion: Completion) -> dict[str, Any]:
    return {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


async def _json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object. A large one is parsed off the event loop (96 MiB of JSON takes about a
    second), so other streams keep streaming meanwhile."""
    raw = await request.read()
    request[BODY_BYTES] = len(raw)
    try:
        body = json.loads(raw) if len(raw) < LARGE_BODY_BYTES else await asyncio.to_thread(json.loads, raw)
    except ValueError as error:  # not JSON, or not UTF-8
        raise InvalidArgument("body", f"is not valid JSON: {error}") from None
    except RecursionError:  # '[' x 100,000
        raise InvalidArgument("body", "nests too deep") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body
