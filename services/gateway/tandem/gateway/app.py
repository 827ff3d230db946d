"""The OpenAI-compatible HTTP front: aiohttp handlers that translate to the services' gRPC calls.

Thin by design: a body is read, bounded and converted (`body_intake.py`, `bodies.py`;
`chat_request.py`, `completion_request.py`, `embed_request.py`), the calls go to the decoder (a Generate
call per choice: `generations.py`, `choices.py`, `choice_streams.py`; a chat's pictures embedded once
each: `images.py`) or the encoder over the Python client's channels (balancing, TLS, retries), and their
events come back as OpenAI objects or server-sent events (`answers.py`, `responses.py`, `embeddings.py`);
every limit on content is the services' own. What the gateway itself guards, each bound answered with an
OpenAI error naming it: the bearer token (the services' token file; a caller's token travels on with its
calls; `middlewares.py`), the body's size
and the time it takes to arrive, large bodies at once and per caller, the size of an embeddings answer,
the choices of a request, open completion streams per caller (its token, else its address) and the choices
of its non-streamed answers being written (as many again), the JSON of those answers, reserved once
decoded (waiting while it does not fit), all callers together and each caller's
(--max-unread-answer-bytes and its share per caller), and a caller
that disconnects: its handler is cancelled (aiohttp's handler cancellation), which cancels every gRPC call
of its request, which frees their KV blocks. Each caller reaches the decoder over a connection of its own
(`callers.py`), so the decoder's per-caller bounds and fair sharing see HTTP callers one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2
from tandem.gateway import embeddings, images
from tandem.gateway.answer_bytes import AnswerBytes
from tandem.gateway.bodies import BodyWorkers
from tandem.gateway.body_intake import LARGE_BODY, BodyIntake
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.callers import GATEWAY_CALLER, CallerChannels, caller_of, model_check_metadata
from tandem.gateway.calls import EmbedCall, GenerateCall
from tandem.gateway.chat_request import chat_request
from tandem.gateway.completion_request import completion_request
from tandem.gateway.config import GatewayConfig
from tandem.gateway.connections import ConnectionGuard
from tandem.gateway.decoder_info import DecoderInfo
from tandem.gateway.embed_request import embed_request
from tandem.gateway.encoder_info import EncoderInfo
from tandem.gateway.encoders import GatewayEncoder, answering
from tandem.gateway.errors import HttpError, Refused, from_grpc
from tandem.gateway.generations import Generations
from tandem.gateway.http_span import UNROUTED, note_sent_status
from tandem.gateway.image_bytes import over_cap, refusal_asking_again
from tandem.gateway.middlewares import Middlewares
from tandem.gateway.refusals import error_response
from tandem.gateway.tasks import all_or_cancel
from tandem.gateway.unrouted import Unrouted, unrouted

HEALTH_PATH = "/health"  # probed by `tandem up`, `tandem wait`, compose and Kubernetes
UNAUTHENTICATED_PATHS = (HEALTH_PATH,)
# How long the gateway's start waits for its decoder replicas' first word (health): a request before
# it would be refused 503 "none serves" only for not having heard yet (`_check_serving`).
FIRST_HEALTH_S = 1.0


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        encoder: GatewayEncoder,
        callers: CallerChannels,
        workers: BodyWorkers,
        guard: ConnectionGuard | None = None,
        tracer: Any = None,
        first_health_s: float = FIRST_HEALTH_S,
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.callers = callers
        self.middlewares = Middlewares(config, UNAUTHENTICATED_PATHS, guard, tracer)
        # How long the start waits for the decoder replicas' first word (FIRST_HEALTH_S; tests of a
        # gateway over no serving decoder set less: each such start waited the whole second).
        self.first_health_s = first_health_s
        self.bodies = BodyIntake(config, workers, self._caller)  # read, bounded, converted
        # Their JSON held, reserved once decoded: all callers' and each caller's.
        self.answer_bytes = AnswerBytes(config.max_unread_answer_bytes, config.unread_answer_bytes_per_caller)
        self.generations = Generations(config, callers, self.answer_bytes)  # each caller's choices bounded
        self.decoder_info = DecoderInfo(self._decoder_stub, lambda: self.callers.targets)
        # Asked again when a picture is over its bound, or the encoder replicas change; with one token.
        self.encoder_info = EncoderInfo(encoder.stub, answering(encoder), model_check_metadata(config))

    @property
    def guard(self) -> ConnectionGuard | None:
        """The connection guard the middlewares tell of each request head: set once the server that
        makes the connections is made, after `app`."""
        return self.middlewares.guard

    @guard.setter
    def guard(self, guard: ConnectionGuard | None) -> None:
        self.middlewares.guard = guard

    def app(self) -> web.Application:
        checks = self.middlewares
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[checks.framing, checks.trace, checks.errors, checks.authenticate],
            # Bodies are decoded by the handlers that read them, never by aiohttp's parser (body_codings'
            # NOTE): for a server made from this app (`tandem serve openai` makes its own handlers,
            # `OpenAIRequestHandler`, which decode nothing either).
            handler_args={"auto_decompress": False},
        )
        app.on_startup.append(self._first_health)
        if checks.tracer is not None:  # the status a span of a request cut after its head was sent says
            app.on_response_prepare.append(note_sent_status)
        # Every route has an expect handler of the gateway's, the unrouted too (`unrouted`, registered
        # last): aiohttp runs a route's before any middleware, and its own answered `Expect: foo` 417 and
        # kept the connection, the framing unchecked (`Transfer-Encoding: ` then a request as the "body":
        # that request answered too), and sent `100 Continue` to a caller with no token, or to GET /health
        # declaring 50 MB, inviting a body no one reads.
        bodiless = {"expect_handler": checks.expect_no_body}
        app.router.add_get(HEALTH_PATH, self.health, **bodiless)
        app.router.add_get("/v1/models", self.models, **bodiless)
        app.router.add_get("/v1/models/{model:.+}", self.model, **bodiless)  # names may hold a "/"
        app.router.add_post("/v1/chat/completions", self.chat, expect_handler=checks.expect_body)
        app.router.add_post("/v1/completions", self.completions, expect_handler=checks.expect_body)
        app.router.add_post("/v1/embeddings", self.embeddings, expect_handler=checks.expect_body)
        catch_all = Unrouted("/{path:.*}", name=UNROUTED)
        app.router.register_resource(catch_all)
        catch_all.add_route("*", unrouted, **bodiless)
        catch_all.take_unmatched(app.router)
        return app

    async def _first_health(self, app: web.Application) -> None:
        """Waits (up to `first_health_s`) for a decoder replica to serve, as the watch hears it."""
        replicas = self.callers.replicas
        deadline = time.monotonic() + self.first_health_s
        while not replicas.called and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # -- endpoints --------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while a decoder replica serves and gets calls, as the gateway's watch of each has seen
        (`replicas.py`; `replica_addresses.py`: one address is one replica, a `dns:` name the replicas it
        resolves to), with the counts serving and watched. Asked live by Check, a single decoder that
        accepted connections and said nothing held every probe for the Check's 2 s. Counted by the rule the
        calls go by (`Replicas.called`): counting only replicas whose model was checked, it said 503 while
        calls went through at a cold start, before any model was asked."""
        replicas = self.callers.replicas
        serving = bool(replicas.called)
        body: dict[str, Any] = {"status": "ok" if serving else "unavailable"}
        # A replica left out keeps "ok" while another serves: the counts tell a deployer how many do.
        body["replicas"] = {"serving": len(replicas.called), "watched": replicas.num_watched}
        if mismatched := replicas.mismatched:
            # Replicas of another model than the gateway serves: left out, named for whoever deploys. One
            # of its name serves another checkpoint under it (`replica_model.py`): what differs is said,
            # or it reads as ours.
            body["model"] = replicas.model
            differences = replicas.differences
            body["other_models"] = [
                {"replica": r, "model": m}
                | ({differences[r]: "differs"} if differences.get(r, "model") != "model" else {})
                for r, m in mismatched.items()
            ]
        if unknown := replicas.model_unknown:
            # Serving, their model not known (being asked, refused, unanswered): a 503 naming nothing, with
            # every replica up, left a deployer nothing to look at.
            body["model"] = replicas.model
            body["model_unknown"] = list(unknown)
        return web.json_response(body, status=200 if serving else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": await self._model_cards(request)})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: one card (the SDK's models.retrieve), or OpenAI's model_not_found."""
        name = request.match_info["model"]
        for card in await self._model_cards(request):
            if card["id"] == name:
                return web.json_response(card)
        message = f"the model {name[:256]!r} does not exist: GET /v1/models lists this server's"
        return error_response(
            HttpError(404, "invalid_request_error", message, "model", code="model_not_found")
        )

    async def _model_cards(self, request: web.Request) -> list[dict[str, Any]]:
        # Asked each time, not cached: adapters load and unload while the gateway runs.
        self._check_serving()
        async with self._decoder_stub() as stub:
            info = await stub.GetModelInfo(
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
        return [card, *adapters]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        info = await self._decoder(request)
        limits = BodyLimits.for_chat(info.max_context_tokens, self._max_choices)
        call = await self.bodies.convert(request, chat_request, limits)
        assert isinstance(call, GenerateCall)
        if info.accepts_encoder_parts:
            images.as_encoder_parts(call)  # the decoder fetches each picture's rows from its encoder
        elif call.images:
            max_message_bytes, metadata = self.config.max_message_bytes, self._metadata(request)
            try:
                await images.embed_images(
                    self.encoder.stub, call, self.encoder_info, max_message_bytes, metadata
                )
            except grpc.aio.AioRpcError as error:  # the encoder's: named so if gRPC failed the call
                raise Refused(from_grpc(error, call.names, "encoder")) from None
        return await self._complete(request, call, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        info = await self._decoder(request)
        limits = BodyLimits.for_completions(info.max_context_tokens, self._max_choices)
        call = await self.bodies.convert(request, completion_request, limits)
        assert isinstance(call, GenerateCall)
        return await self._complete(request, call, "text")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._embeddings(request)
        except grpc.aio.AioRpcError as error:  # every call it makes is the encoder's (its info, Embed)
            raise Refused(from_grpc(error, service="encoder")) from None

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        metadata = self._metadata(request)
        info = await self.encoder_info.get(metadata)
        limits = BodyLimits.for_embeddings(info.max_input_tokens)
        call = await self.bodies.convert(request, embed_request, limits)
        assert isinstance(call, EmbedCall)
        bound = embeddings.answer_bound(call, info)
        embeddings.check_answer_size(call, info, self.config.max_embeddings_bytes)  # before any call
        max_message_bytes = self.config.max_message_bytes
        embeddings.check_reply_sizes(call, info, max_message_bytes)
        for i, input_request in enumerate(call.requests):
            where = call.input_field(i, "image")
            if input_request.HasField("image") and (
                too_large := await refusal_asking_again(
                    self.encoder_info, max_message_bytes, input_request, where
                )
            ):
                raise Refused(too_large)
        if bound >= self.config.large_body_bytes and LARGE_BODY not in request:
            self.bodies.take_large_body(request)  # the replies and the answer are large too

        async def embed(i: int, embed_request: encoder_pb2.EmbedRequest) -> encoder_pb2.EmbedResponse:
            try:
                return await self.encoder.stub.Embed(embed_request, metadata=metadata)
            except grpc.aio.AioRpcError as error:  # named as the body names the input that failed
                where = call.input_field(i, "image" if embed_request.HasField("image") else "text")
                if (too_large := over_cap(error, embed_request, where, self.encoder_info)) is not None:
                    raise Refused(too_large) from None
                raise Refused(from_grpc(error, service="encoder").for_input(call.input_field, i)) from None

        replies = await all_or_cancel([embed(i, c) for i, c in enumerate(call.requests)])
        return await embeddings.write_answer(request, call, replies, call.model or info.model)

    async def _complete(self, request: web.Request, call: GenerateCall, kind: str) -> web.StreamResponse:
        base = (await self._decoder(request)).model
        model = call.model or base
        for generate in call.requests:
            if generate.model and generate.model != base:  # as in vLLM: a LoRA adapter, by its name
                generate.adapter, generate.model = generate.model, ""
        caller, metadata = self._caller(request), self._metadata(request)
        return await self.generations.complete(request, call, kind, caller, model, metadata)

    @property
    def _max_choices(self) -> int:
        """Choices a request may ask: never more than a caller may have streams open."""
        return min(self.config.max_choices, self.config.max_streams_per_caller)

    def _caller(self, request: web.Request) -> str:
        """Who sends `request`: its checked bearer token, else its address (`callers.caller_of`)."""
        return caller_of(
            request.headers.get("Authorization", ""), request.remote, self.config.auth_tokens is not None
        )

    def _metadata(self, request: web.Request) -> tuple[tuple[str, str], ...] | None:
        """The caller's token, passed on when the gateway checks tokens (the services accept the same),
        unless the gateway has a token of its own for them."""
        if self.config.auth_tokens is None or self.config.upstream.token is not None:
            return None
        return (("authorization", request.headers["Authorization"]),)

    async def _decoder(self, request: web.Request) -> decoder_pb2.DecoderGetModelInfoResponse:
        """The decoder's model info (its name, its context), kept fresh (decoder_info.py)."""
        self._check_serving()
        return await self.decoder_info.get(self._metadata(request))

    def _check_serving(self) -> None:
        """Raises Unavailable (the gateway's 503) where no decoder replica serves, as its watch has
        heard. Before any replica said a model, calls went to every replica (`replicas.py`): to one
        that accepted connections and said nothing, a completion waited 5.4 s for gRPC's "connection
        attempt timed out before receiving SETTINGS frame", /v1/models 10 s for its timeout."""
        if not self.callers.replicas.called:
            raise Unavailable(self.callers.replicas.none_serving())

    async def close(self) -> None:
        """Ends the model-info asks under way (at shutdown, before the channels close)."""
        await self.decoder_info.close()
        await self.encoder_info.close()

    @contextlib.asynccontextmanager
    async def _decoder_stub(self) -> AsyncIterator[decoder_pb2_grpc.DecoderStub]:
        """The gateway's own decoder stub: a channel over the replicas its watch has seen serve, as a
        caller's is (`callers.py`): one balanced over every replica, watching none, gave a loading or
        failed one its share of model-info calls, each UNAVAILABLE."""
        async with self.callers.stub(GATEWAY_CALLER) as stub:
            yield stub
