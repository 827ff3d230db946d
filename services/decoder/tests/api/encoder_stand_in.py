"""A stand-in encoder for the decoder's encoder-part tests, and the parts fetching from it.

`StandIn` serves tandem.v1.Encoder on 127.0.0.1, counts its Embed calls and answers when a test opens
its gate, with rows that depend on the input's bytes (`rows_of`); its flags make it refuse, fail, hang
or answer wrongly. The fixtures (`stand_in`, `encoder`, `parts`) reach the tests of this folder through
its conftest.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest
import torch

from tandem.client import status
from tandem.client.errors import TandemError
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.common import replica_name
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import EncoderPrompt, PromptPart
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.engine.admission.prompt import GenerateSpec

HIDDEN_SIZE = 8
PICTURE = b"\x89PNG a picture"
SETTLE_S = 0.2  # long enough for every fetch started to have reached the encoder, were it to


class StandIn(encoder_pb2_grpc.EncoderServicer):
    """Embeds an input into rows that depend on its bytes, once `gate` is open."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.num_embeds = 0  # Embed calls received
        self.num_running = 0
        self.max_running = 0  # the most Embed calls running at once
        self.num_cancelled = 0  # Embed calls their caller cancelled
        self.refused_token = ""  # a bearer token whose calls are refused
        self.is_refusing_all = False
        self.is_malformed = False  # replies with rows of rank 1
        self.is_non_finite = False  # replies with a NaN in its rows
        self.rows: torch.Tensor | None = None  # replies with these rows, not ones made from the input
        self.trace_headers: list[dict[str, str]] = []  # each Embed call's traceparent and tracestate
        self.is_info_hung = False  # GetModelInfo never answers
        self.num_infos = 0  # GetModelInfo calls received
        self.num_infos_cancelled = 0  # GetModelInfo calls their caller cancelled
        self.replica = ""  # its own name, said as each call begins, as Tandem's encoder does
        self.failure: grpc.StatusCode | None = None  # Embed ends with this status
        self.refusal: TandemError | None = None  # Embed ends with this error, its details and all
        self.embedder = ""  # GetModelInfo's embedder kind
        self.poolings: list[int] = []  # each Embed call's pooling, as asked

    async def _say_who(self, context) -> None:
        if self.replica:
            await context.send_initial_metadata(((replica_name.HEADER, self.replica),))

    async def GetModelInfo(self, request, context) -> encoder_pb2.EncoderGetModelInfoResponse:
        await self._say_who(context)
        self.num_infos += 1
        if self.is_info_hung:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.num_infos_cancelled += 1
                raise
        return encoder_pb2.EncoderGetModelInfoResponse(
            model="stand-in", embedder=self.embedder, hidden_size=HIDDEN_SIZE
        )

    async def Embed(self, request, context) -> encoder_pb2.EmbedResponse:
        await self._say_who(context)
        self.num_embeds += 1
        self.poolings.append(request.pooling)
        self.num_running += 1
        self.max_running = max(self.max_running, self.num_running)
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.num_running -= 1
        metadata = dict(context.invocation_metadata())
        self.trace_headers.append({k: v for k, v in metadata.items() if k in ("traceparent", "tracestate")})
        token = metadata.get("authorization", "")
        if self.is_refusing_all or (self.refused_token and token == self.refused_token):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a picture")
        if self.failure is not None:
            await context.abort(self.failure, "out of order")
        if self.refusal is not None:
            status.end_with(context, self.refusal)
            return encoder_pb2.EmbedResponse()
        rows = rows_of(request.image.data) if self.rows is None else self.rows
        if self.is_non_finite:
            rows[1, 2] = float("nan")
        return encoder_pb2.EmbedResponse(embeddings=tensors.encode(rows[0] if self.is_malformed else rows))


def rows_of(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data[:3]), dtype=torch.float32)[:, None].expand(3, HIDDEN_SIZE).contiguous()


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[StandIn, RunningServer]]:
    servicer = StandIn()
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0),
        [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    await server.set_serving()
    try:
        yield servicer, server
    finally:
        await server.stop(0)


@pytest.fixture
def encoder(stand_in: tuple[StandIn, RunningServer]) -> StandIn:
    return stand_in[0]


@pytest.fixture
async def parts(stand_in: tuple[StandIn, RunningServer], tmp_path) -> AsyncIterator[EncoderParts]:
    parts = EncoderParts(
        stand_in[1].address,
        torch.float32,
        1 << 20,
        cache_bytes=1 << 20,
        shm_dir=tmp_path,
        hidden_size=HIDDEN_SIZE,
    )
    try:
        yield parts
    finally:
        await parts.close()


def start_fetches(
    parts: EncoderParts,
    prompt: Sequence[PromptPart],
    token: str = "",
    time_remaining_s: float | None = None,
) -> tuple[list[EncoderPrompt], list[asyncio.Task]]:
    """The call's encoder parts, each with its rows fetching, and the fetches."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    spec, fetches = parts.start(GenerateSpec(prompt=prompt), metadata, time_remaining_s)
    return [part for part in spec.prompt if isinstance(part, EncoderPrompt)], fetches


async def fetched_rows(part: EncoderPrompt) -> torch.Tensor:
    assert part.rows is not None
    return await asyncio.wait_for(asyncio.wrap_future(part.rows), 10)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def picture() -> EncoderPrompt:
    return EncoderPrompt("image", PICTURE)
