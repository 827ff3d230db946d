"""A decoder for the gateway's tests: the Decoder service over gRPC on a free loopback port, answering
from the request alone, so a test can tell which prompt and which seed each answer came from, and
keeping count of the streams it holds open and of those the gateway cancelled.

Its answer to a prompt P (the text of its segments, token IDs as `ids:1,2`, or a chat's messages, a
picture's rows as `[image <their first 4 bytes in hex>]`) with seed S: the deltas `<P>` then ` seed=S`
(`seed=none` unseeded), then ` x` up to max_tokens (2 unless set), finished LENGTH with P's characters
as prompt tokens. A prompt holding `refuse` is refused as too long (field `prompt`), an ID over 999 as
out of the vocabulary (field `prompt[j].token_ids.ids[k]`, ID k of segment j), a max_new_tokens over 50
as over the context (`stopping.max_new_tokens`); one holding `hang` streams ` .` until cancelled,
`flood` deltas of FLOOD_BYTES as fast as they are taken until cancelled;
`break` fails after its deltas; `drain` ends ABORTED; `after2` waits until two other streams are open
(so that its neighbours are accepted before it is refused). With output.prompt_logprobs N, its first
delta scores P character by character (`prompt_scores`), and a prompt holding `budget` (`budget:L`, else
L 1) is refused RESOURCE_EXHAUSTED naming `output.prompt_logprobs` in the decoder's words and with its
ErrorInfo (PROMPT_LOGPROB_BUDGET) where the entries (positions x (1 + N)) of its open streams asking for
them and its own are over L, as the decoder refuses a caller over its budget; holding `wordsonly` too,
with the words alone, as a decoder from before the ErrorInfo did.

Started with an encoder (`fake_decoder(encoder_address)`), it is a decoder started with `--encoder`:
it takes `encoder` parts and, as the real one does (`tandem.decoder.api.encoder_parts`), fetches their
rows from that encoder before it accepts the call, every part of a call at once, each looked up first
among the rows it fetched before (its `--encoder-cache-bytes`), which a fetch fills once it returns,
then among the fetches running: a picture being fetched for another call (or twice in one call) is
awaited, not fetched again.

Its gRPC health says SERVING, the whole server's ("") and tandem.v1.Decoder's, the one the gateway
watches, as the decoder's does, until a test sets another (`set_health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from tandem.client import error_reasons as reasons
from tandem.client.errors import InvalidArgument, ResourceExhausted
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tandem.client.status import end_with
from tandem.gateway.callers import DECODER_SERVICE

MODEL = "fake-model"
CONTEXT = 4096
VOCAB = 1000
MAX_NEW_TOKENS = 50
FLOOD_BYTES = 4096  # the text of a `flood` delta: it fills a caller's buffers in a moment


def prompt_text(request: decoder_pb2.GenerateRequest, fetched: dict[bytes, bytes] | None = None) -> str:
    """The prompt as the fake reads it; `fetched`: the rows of the call's encoder parts, by picture."""
    if request.HasField("chat"):
        return "".join(_part_text(part, fetched or {}) for m in request.chat.messages for part in m.content)
    return "".join(
        s.text if s.WhichOneof("segment") == "text" else "ids:" + ",".join(map(str, s.token_ids.ids))
        for s in request.prompt
    )


def _part_text(part: decoder_pb2.ChatContentPart, fetched: dict[bytes, bytes]) -> str:
    kind = part.WhichOneof("part")
    if kind == "image":
        return f"[image {part.image.data[:4].hex()}]"
    if kind == "encoder":
        return f"[image {fetched[part.encoder.image.data][:4].hex()}]"
    return part.text


@dataclass
class FakeDecoder(decoder_pb2_grpc.DecoderServicer):
    requests: list[decoder_pb2.GenerateRequest] = field(default_factory=list)  # every Generate, in order
    cancelled: list[str] = field(default_factory=list)  # request IDs of streams cancelled by the caller
    num_open: int = 0  # streams accepted and not yet ended
    scored_entries: int = 0  # the prompt-logprob entries of those that asked for them (`budget`)
    encoder: encoder_pb2_grpc.EncoderStub | None = None  # None: `encoder` parts are not accepted
    cached_rows: dict[bytes, bytes] = field(default_factory=dict)  # fetched rows, by picture
    fetching: dict[bytes, asyncio.Task[bytes]] = field(default_factory=dict)  # fetches running, by picture
    health: HealthServicer = field(default_factory=HealthServicer)  # "" and tandem.v1.Decoder: SERVING

    async def set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """The server's health and its Decoder service's, as the decoder sets both."""
        for service in ("", DECODER_SERVICE):
            await self.health.set(service, status)

    async def GetModelInfo(
        self, request: decoder_pb2.DecoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderGetModelInfoResponse:
        return decoder_pb2.DecoderGetModelInfoResponse(
            model=MODEL,
            max_context_tokens=CONTEXT,
            vocab_size=VOCAB,
            accepts_encoder_parts=self.encoder is not None,
        )

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        self.requests.append(request)
        prompt = prompt_text(request, await self._fetch_rows(request))
        if "after2" in prompt:
            async with asyncio.timeout(5):
                while self.num_open < 2:
                    await asyncio.sleep(0.005)
        if (refusal := _refusal(request, prompt, self.scored_entries)) is not None:
            end_with(context, refusal)
            return
        self.num_open += 1
        entries = _entries(request, prompt)
        self.scored_entries += entries
        try:
            yield decoder_pb2.GenerateResponse(
                request_id=request.request_id, accepted=decoder_pb2.PromptAccepted(prompt_tokens=len(prompt))
            )
            while "flood" in prompt:
                yield _delta(request, " " * FLOOD_BYTES, 0)
            while "hang" in prompt:
                yield _delta(request, " .", 0)
                await asyncio.sleep(0.01)
            seed = request.sampling.seed if request.sampling.HasField("seed") else "none"
            num_tokens = request.stopping.max_new_tokens or 2
            texts = [f"<{prompt}>", f" seed={seed}", *[" x"] * (num_tokens - 2)][:num_tokens]
            for k, text in enumerate(texts):
                response = _delta(request, text, k)
                if k == 0 and request.output.HasField("prompt_logprobs"):
                    response.delta.prompt_logprobs.extend(
                        prompt_scores(prompt, request.output.prompt_logprobs)
                    )
                yield response
            if "break" in prompt:
                end_with(context, InvalidArgument("prompt", "broke after its tokens"))
                return
            reason = (
                decoder_pb2.FINISH_REASON_ABORTED if "drain" in prompt else decoder_pb2.FINISH_REASON_LENGTH
            )
            finished = decoder_pb2.Finished(reason=reason)
            finished.usage.input_tokens, finished.usage.output_tokens = len(prompt), len(texts)
            yield decoder_pb2.GenerateResponse(request_id=request.request_id, finished=finished)
        except (asyncio.CancelledError, GeneratorExit):
            # A cancellation that lands while the stream is parked at a yield (not in the sleep) reaches
            # the generator as aclose()'s GeneratorExit: counted too, as num_open's finally counts it.
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.num_open -= 1
            self.scored_entries -= entries

    async def _fetch_rows(self, request: decoder_pb2.GenerateRequest) -> dict[bytes, bytes]:
        """The rows of the call's encoder parts (pictures), by picture: cached, being fetched, or fetched
        at once."""
        pictures = [
            part.encoder.image.data
            for message in request.chat.messages
            for part in message.content
            if part.WhichOneof("part") == "encoder"
        ]
        if pictures and self.encoder is None:
            raise AssertionError("an encoder part sent to a decoder without an encoder")

        async def fetch(picture: bytes) -> bytes:
            assert self.encoder is not None
            embed = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=picture))
            try:
                self.cached_rows[picture] = (await self.encoder.Embed(embed)).embeddings.data
            finally:
                del self.fetching[picture]
            return self.cached_rows[picture]

        async def rows(picture: bytes) -> bytes:
            if picture in self.cached_rows:
                return self.cached_rows[picture]
            if picture not in self.fetching:
                self.fetching[picture] = asyncio.ensure_future(fetch(picture))
            return await asyncio.shield(self.fetching[picture])

        return dict(zip(pictures, await asyncio.gather(*(rows(p) for p in pictures)), strict=True))

    async def wait_until_none_open(self, timeout_s: float = 5.0) -> None:
        """Until every accepted stream has ended (a cancellation reaches the server a moment later)."""
        async with asyncio.timeout(timeout_s):
            while self.num_open:
                await asyncio.sleep(0.01)


def prompt_scores(prompt: str, top: int) -> list[decoder_pb2.PromptLogprob]:
    """The fake's prompt logprobs of `prompt`: a position per character, its token ID the character's
    code point modulo VOCAB, spelled by its UTF-8 bytes, at logprob -p (position p); its `top`
    likeliest IDs 0 .. top - 1 at -0.5 - k, each spelled `tK`."""
    scores = []
    for p, character in enumerate(prompt):
        entry = decoder_pb2.PromptLogprob(token_id=ord(character) % VOCAB, token_bytes=character.encode())
        if p:
            entry.logprob = -float(p)
            if top:
                entry.top_logprobs.token_ids.extend(range(top))
                entry.top_logprobs.logprobs.extend(-0.5 - k for k in range(top))
                entry.top_logprobs.token_bytes.extend(f"t{k}".encode() for k in range(top))
        scores.append(entry)
    return scores


def _entries(request: decoder_pb2.GenerateRequest, prompt: str) -> int:
    """The prompt-logprob entries a stream holds: its positions (P's characters) x (1 + N)."""
    return (
        len(prompt) * (1 + request.output.prompt_logprobs)
        if request.output.HasField("prompt_logprobs")
        else 0
    )


def _refusal(
    request: decoder_pb2.GenerateRequest, prompt: str, held: int
) -> InvalidArgument | ResourceExhausted | None:
    needs = _entries(request, prompt)
    if "budget" in prompt and needs:
        limit = int(match[1]) if (match := re.search(r"budget:(\d+)", prompt)) else 1
        if held + needs > limit:
            numbers = {reasons.HELD_ENTRIES: held, reasons.NEEDED_ENTRIES: needs, reasons.MAX_ENTRIES: limit}
            return ResourceExhausted(
                f"output.prompt_logprobs: this caller's open streams already hold {held} prompt-logprob "
                f"entries; this request needs {needs} more (positions x (1 + top)) and the limit is {limit}; "
                f"read or end a stream that scores its prompt",
                info=None
                if "wordsonly" in prompt
                else reasons.decoder_info(reasons.PROMPT_LOGPROB_BUDGET, numbers),
            )
    if "refuse" in prompt:
        return InvalidArgument("prompt", f"{len(prompt)} positions leave no room to generate")
    for j, segment in enumerate(request.prompt):
        for k, token_id in enumerate(segment.token_ids.ids):
            if token_id >= VOCAB:
                return InvalidArgument(f"prompt[{j}].token_ids.ids[{k}]", f"{token_id} is not below {VOCAB}")
    if request.stopping.max_new_tokens > MAX_NEW_TOKENS:
        return InvalidArgument(
            "stopping.max_new_tokens",
            f"prompt + max_new_tokens ({request.stopping.max_new_tokens}) exceeds 52",
        )
    return None


def _delta(request: decoder_pb2.GenerateRequest, text: str, k: int) -> decoder_pb2.GenerateResponse:
    delta = decoder_pb2.TokenDelta(text=text, token_ids=[k])
    if request.output.logprobs:
        delta.logprobs.append(-0.5 * (k + 1))
        top = delta.top_logprobs.add()
        top.token_ids.extend(range(request.output.top_logprobs))
        top.logprobs.extend([-1.0] * request.output.top_logprobs)
    return decoder_pb2.GenerateResponse(request_id=request.request_id, delta=delta)


@contextlib.asynccontextmanager
async def fake_decoder(encoder_address: str | None = None) -> AsyncIterator[tuple[FakeDecoder, str]]:
    """The fake serving on a free loopback port: itself and its address; stopped afterwards. With
    `encoder_address`, it fetches the rows of encoder parts from that encoder."""
    async with contextlib.AsyncExitStack() as stack:
        decoder = FakeDecoder()
        if encoder_address is not None:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(encoder_address))
            decoder.encoder = encoder_pb2_grpc.EncoderStub(channel)
        server = grpc.aio.server()
        decoder_pb2_grpc.add_DecoderServicer_to_server(decoder, server)
        health_pb2_grpc.add_HealthServicer_to_server(decoder.health, server)
        await decoder.set_health(health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield decoder, f"127.0.0.1:{port}"
        finally:
            await server.stop(0)
