"""Fetches of one input running at once share one Embed call: n calls asking for one picture (or one
call holding it twice) cost one encode, each gets the rows or the error named on its own field, a
caller leaving does not end the others' fetch, and only the last one leaving cancels the call. A
caller with another bearer token fetches on its own, and a fetch that ran out of its first caller's
deadline is fetched again by a caller with time left. Parts asking the model's name at once share one
GetModelInfo call, each answered at its own time. A message over either side's --max-message-bytes
is the caller's INVALID_ARGUMENT naming whose. The encoder is a stand-in on 127.0.0.1 that
counts its Embed calls and answers when a test opens its gate."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import pytest
import torch

from common.tests.ports import free_port
from tandem.client import status
from tandem.client.errors import (
    DeadlineExceeded,
    ErrorInfo,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    TandemError,
    Unavailable,
)
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.common import replica_name
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import EncoderPrompt, PromptPart, TextPrompt
from tandem.decoder.api import encoder_parts
from tandem.decoder.api.embed_replies import READ_ON_A_THREAD_BYTES, EmbedReplies
from tandem.decoder.api.encoder_parts import MAX_EMBEDS_IN_FLIGHT, MAX_FETCHES_PER_CALL, EncoderParts
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
        rows = _rows_of(request.image.data) if self.rows is None else self.rows
        if self.is_non_finite:
            rows[1, 2] = float("nan")
        return encoder_pb2.EmbedResponse(embeddings=tensors.encode(rows[0] if self.is_malformed else rows))


def _rows_of(data: bytes) -> torch.Tensor:
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


def _start(
    parts: EncoderParts,
    prompt: Sequence[PromptPart],
    token: str = "",
    time_remaining_s: float | None = None,
) -> tuple[list[EncoderPrompt], list[asyncio.Task]]:
    """The call's encoder parts, each with its rows fetching, and the fetches."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    spec, fetches = parts.start(GenerateSpec(prompt=prompt), metadata, time_remaining_s)
    return [part for part in spec.prompt if isinstance(part, EncoderPrompt)], fetches


async def _rows(part: EncoderPrompt) -> torch.Tensor:
    assert part.rows is not None
    return await asyncio.wait_for(asyncio.wrap_future(part.rows), 10)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def _picture() -> EncoderPrompt:
    return EncoderPrompt("image", PICTURE)


async def test_two_calls_asking_for_one_picture_at_once_cost_one_embed(
    encoder: StandIn, parts: EncoderParts
) -> None:
    [first], _ = _start(parts, [_picture(), TextPrompt("what is it?")])
    [second], _ = _start(parts, [TextPrompt("and this?"), _picture()])
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    rows = [await _rows(first), await _rows(second)]
    assert encoder.num_embeds == 1 and parts.fetches.num_started == 1 and parts.fetches.num_joined == 1
    assert torch.equal(rows[0], _rows_of(PICTURE)) and torch.equal(rows[1], rows[0])
    [again], _ = _start(parts, [_picture()])
    assert torch.equal(await _rows(again), rows[0]) and encoder.num_embeds == 1  # cached since


async def test_one_call_holding_a_picture_twice_costs_one_embed(
    encoder: StandIn, parts: EncoderParts
) -> None:
    [first, second], _ = _start(parts, [_picture(), TextPrompt("the same as"), _picture()])
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    assert torch.equal(await _rows(first), await _rows(second))
    assert encoder.num_embeds == 1 and parts.fetches.num_joined == 1


async def test_a_caller_leaving_leaves_the_others_fetch_running_to_its_end(
    encoder: StandIn, parts: EncoderParts
) -> None:
    [staying], _ = _start(parts, [_picture()])
    [leaving], fetches = _start(parts, [_picture()])
    await asyncio.sleep(SETTLE_S)
    for fetch in fetches:
        fetch.cancel()
    await asyncio.sleep(SETTLE_S)
    assert leaving.rows is not None and leaving.rows.cancelled()
    encoder.gate.set()
    assert torch.equal(await _rows(staying), _rows_of(PICTURE))
    assert encoder.num_embeds == 1 and encoder.num_cancelled == 0


async def test_the_first_caller_leaving_leaves_its_fetch_to_the_one_still_waiting(
    encoder: StandIn, parts: EncoderParts
) -> None:
    [leaving], fetches = _start(parts, [_picture()])
    await asyncio.sleep(SETTLE_S)  # the first caller's Embed call is running
    [staying], _ = _start(parts, [_picture()])
    await asyncio.sleep(SETTLE_S)
    for fetch in fetches:
        fetch.cancel()
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    assert torch.equal(await _rows(staying), _rows_of(PICTURE))
    assert encoder.num_embeds == 1 and encoder.num_cancelled == 0


async def test_the_embed_call_is_cancelled_once_every_caller_has_left(
    encoder: StandIn, parts: EncoderParts
) -> None:
    fetches = [fetch for _ in range(2) for fetch in _start(parts, [_picture()])[1]]
    await _until(lambda: encoder.num_embeds == 1)
    await asyncio.sleep(SETTLE_S)
    for fetch in fetches:
        fetch.cancel()
    await _until(lambda: encoder.num_cancelled > 0)
    assert encoder.num_embeds == 1 and encoder.num_cancelled == 1 and encoder.num_running == 0
    [later], _ = _start(parts, [_picture()])  # the abandoned fetch is not joined: a new one starts
    encoder.gate.set()
    assert torch.equal(await _rows(later), _rows_of(PICTURE)) and encoder.num_embeds == 2


async def test_the_encoders_refusal_reaches_every_caller_on_its_own_field(
    encoder: StandIn, parts: EncoderParts
) -> None:
    encoder.is_refusing_all = True
    first, _ = _start(parts, [_picture(), TextPrompt("and"), _picture()])
    second, _ = _start(parts, [TextPrompt("look:"), _picture()])
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    fields = []
    for part in [*first, *second]:
        with pytest.raises(InvalidArgument) as error:
            await _rows(part)
        assert error.value.description == "the encoder refused it: not a picture"
        fields.append(error.value.field)
    assert fields == ["prompt[0].encoder", "prompt[2].encoder", "prompt[1].encoder"]
    assert encoder.num_embeds == 1


# Another server's reason: as it came, the gateway answered 400 on prompt_logprobs for an encoder full.
NOT_THE_ENCODERS = ErrorInfo("PROMPT_LOGPROB_BUDGET", "tandem.decoder", {"maxEntries": "1"})
ENCODERS_CALL_LIMIT = ErrorInfo("CALL_LIMIT", "tandem.encoder", {"maxCalls": "1"})


@pytest.mark.parametrize(
    ("encoders_delay_s", "passed_on_s"), [(3.5, 3.5), (None, 1.0), (-5.0, 1.0), (0.0, 1.0), (3e9, 1.0)]
)
async def test_an_encoder_full_is_passed_on_with_its_own_retry_delay_or_a_second_where_it_gave_none(
    encoder: StandIn, parts: EncoderParts, encoders_delay_s: float | None, passed_on_s: float
) -> None:
    """The caller retries when the encoder said it has room: its RetryInfo was dropped, every one
    passed on as 1 s. An ErrorInfo not the encoder's own is not passed on."""
    encoder.refusal = ResourceExhausted("no room", encoders_delay_s, info=NOT_THE_ENCODERS)
    encoder.gate.set()
    (part,), _ = _start(parts, [_picture()])
    with pytest.raises(ResourceExhausted) as error:
        await _rows(part)
    assert "is full: no room" in error.value.message
    assert (error.value.retry_after_s, error.value.info) == (passed_on_s, None)


@pytest.mark.parametrize(
    ("refusal", "field", "description"),
    [
        (  # a field of the part's input: named under the part, in its BadRequest as in its message
            InvalidArgument("image.data", "cannot be preprocessed", info=NOT_THE_ENCODERS),
            "prompt[1].encoder.image.data",
            "the encoder refused it: cannot be preprocessed",
        ),
        (
            FailedPrecondition("image", "this encoder takes no images", info=NOT_THE_ENCODERS),
            "prompt[1].encoder.image",
            "the encoder refused it: this encoder takes no images",
        ),
        (  # a field of an input the part did not send (it sent an image): the part's
            InvalidArgument("token_ids.ids[3]", "must be in [0, 49152)", info=NOT_THE_ENCODERS),
            "prompt[1].encoder",
            "the encoder refused it: token_ids.ids[3]: must be in [0, 49152)",
        ),
        (  # the encoder's own reason, but one of RESOURCE_EXHAUSTED: a 400 with it read as retryable
            InvalidArgument("image.data", "cannot be preprocessed", info=ENCODERS_CALL_LIMIT),
            "prompt[1].encoder.image.data",
            "the encoder refused it: cannot be preprocessed",
        ),
        (  # a field the decoder set, no field of the caller's: the part, the encoder's words after it
            InvalidArgument("output_dtype", "FLOAT64 is not served", info=NOT_THE_ENCODERS),
            "prompt[1].encoder",
            "the encoder refused it: output_dtype: FLOAT64 is not served",
        ),
        (  # shaped like the decoder's own field, which the gateway renames: the part's
            InvalidArgument("text.sampling.temperature", "bad", info=NOT_THE_ENCODERS),
            "prompt[1].encoder",
            "the encoder refused it: text.sampling.temperature: bad",
        ),
    ],
)
async def test_the_encoders_refusal_is_passed_on_with_its_details_its_field_under_the_parts(
    encoder: StandIn, parts: EncoderParts, refusal: TandemError, field: str, description: str
) -> None:
    # Its BadRequest field was dropped: the caller's field was the part's alone. Its ErrorInfo goes on only
    # where it is the encoder's own, with RESOURCE_EXHAUSTED (CALL_LIMIT: the test below).
    encoder.refusal = refusal
    encoder.gate.set()
    (part,), _ = _start(parts, [TextPrompt("look:"), _picture()])
    with pytest.raises(type(refusal)) as error:
        await _rows(part)
    assert (error.value.field, error.value.description, error.value.info) == (field, description, None)


async def test_an_encoder_full_is_passed_on_with_its_error_info(tmp_path) -> None:
    """Its bound on calls at once (CALL_LIMIT, in the encoder's domain) says so through the decoder."""
    servicer = StandIn()
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_concurrent_rpcs=1),
        [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    parts = EncoderParts(
        server.address, torch.float32, 1 << 20, cache_bytes=1 << 20, shm_dir=tmp_path, hidden_size=HIDDEN_SIZE
    )
    try:
        (held,), _ = _start(parts, [_picture()])  # its Embed call holds the encoder's one place
        await _until(lambda: servicer.num_embeds == 1)
        (part,), _ = _start(parts, [EncoderPrompt("image", b"another picture")])
        with pytest.raises(ResourceExhausted) as error:
            await _rows(part)
        assert "this server runs at most 1 calls at once" in error.value.message
        assert error.value.info == ENCODERS_CALL_LIMIT
        assert error.value.retry_after_s == 1.0
        servicer.gate.set()
        assert torch.equal(await _rows(held), _rows_of(PICTURE))
    finally:
        await parts.close()
        await server.stop(0)


async def test_a_malformed_reply_is_refused_to_every_caller_on_its_own_field(
    encoder: StandIn, parts: EncoderParts
) -> None:
    encoder.is_malformed = True
    [first], _ = _start(parts, [_picture()])
    [second], _ = _start(parts, [TextPrompt("look:"), _picture()])
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    for part, field in [(first, "prompt[0]"), (second, "prompt[1]")]:
        # The encoder's fault, never INVALID_ARGUMENT on the caller's field, as it was.
        with pytest.raises(Unavailable, match="expected rank 2") as error:
            await _rows(part)
        assert str(error.value).startswith(f"{field}.encoder: encoder {parts.address} is unavailable (")
        assert "its reply's .embeddings.shape: " in str(error.value)
    assert encoder.num_embeds == 1


async def test_rows_holding_nan_are_refused_and_not_cached_so_the_next_call_fetches_them_again(
    encoder: StandIn, parts: EncoderParts
) -> None:
    """An encoder's fault (a NaN in one reply) lives as long as that call, not on in the cache."""
    encoder.is_non_finite = True
    encoder.gate.set()
    [first], _ = _start(parts, [_picture()])
    with pytest.raises(Unavailable) as error:
        await _rows(first)
    assert str(error.value).startswith(f"prompt[0].encoder: encoder {parts.address} is unavailable (")
    assert "its reply's .embeddings.data: " in str(error.value)
    assert "NaN or Inf as sent, in float32 (first at index [1, 2])" in str(error.value)
    encoder.is_non_finite = False
    [again], _ = _start(parts, [_picture()])
    assert torch.equal(await _rows(again), _rows_of(PICTURE))
    assert encoder.num_embeds == 2


async def test_rows_of_another_width_are_the_encoders_fault_and_not_cached_so_its_fix_mends_them(
    encoder: StandIn, parts: EncoderParts
) -> None:
    """Rows [3, 2 x hidden] are the encoder's fault (another model), UNAVAILABLE naming it, as NaN is:
    they were INVALID_ARGUMENT on the caller's field, cached, and refused again once the encoder was
    fixed."""
    encoder.rows = torch.ones(3, 2 * HIDDEN_SIZE)
    encoder.gate.set()
    [first], _ = _start(parts, [_picture()])
    with pytest.raises(Unavailable) as error:
        await _rows(first)
    assert str(error.value).startswith(f"prompt[0].encoder: encoder {parts.address} is unavailable (")
    assert f"its reply's .embeddings.shape: rows [3, {2 * HIDDEN_SIZE}], this decoder's model takes" in str(
        error.value
    )
    encoder.rows = None
    [again], _ = _start(parts, [_picture()])
    assert torch.equal(await _rows(again), _rows_of(PICTURE))
    assert encoder.num_embeds == 2


async def test_rows_over_a_mebibyte_are_checked_off_the_event_loop(
    encoder: StandIn, stand_in: tuple[StandIn, RunningServer], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cast and the finiteness check of large rows (163 ms for 8,192 x 4,096 bf16 rows) would hold
    every stream and health check of the decoder while they ran on its loop."""
    checked_on: list[bool] = []  # whether each check ran on the event loop's thread
    check = EmbedReplies._checked

    def recording(self: EmbedReplies, rows: torch.Tensor, where: str) -> torch.Tensor:
        checked_on.append(threading.current_thread() is threading.main_thread())
        return check(self, rows, where)

    monkeypatch.setattr(EmbedReplies, "_checked", recording)
    parts = EncoderParts(stand_in[1].address, torch.float32, 4 << 20, cache_bytes=8 << 20, shm_dir=tmp_path)
    try:
        encoder.gate.set()
        encoder.rows = torch.ones(READ_ON_A_THREAD_BYTES // (4 * HIDDEN_SIZE) + 1, HIDDEN_SIZE)
        [large], _ = _start(parts, [_picture()])
        assert torch.equal(await _rows(large), encoder.rows)
        encoder.rows = torch.ones(4, HIDDEN_SIZE)
        [small], _ = _start(parts, [EncoderPrompt("image", b"another picture")])
        assert torch.equal(await _rows(small), encoder.rows)
    finally:
        await parts.close()
    assert checked_on == [False, True]


async def test_rows_over_the_decoders_message_cap_sent_as_bytes_are_the_callers_invalid_argument(
    encoder: StandIn, stand_in: tuple[StandIn, RunningServer], tmp_path
) -> None:
    """gRPC refuses a reply over this decoder's --max-message-bytes as RESOURCE_EXHAUSTED, which read
    "encoder ... is full" with a RetryInfo: no retry mends a long input. Through shared memory the same
    rows were already INVALID_ARGUMENT on the caller's field."""
    parts = EncoderParts(stand_in[1].address, torch.float32, 64 * 1024, cache_bytes=0, shm_dir=tmp_path)
    try:
        encoder.gate.set()
        encoder.rows = torch.ones(4096, HIDDEN_SIZE)  # 128 KiB of rows
        [part], _ = _start(parts, [TextPrompt("look:"), _picture()])
        with pytest.raises(InvalidArgument) as error:
            await _rows(part)
    finally:
        await parts.close()
    assert error.value.field == "prompt[1].encoder"
    assert error.value.description == (
        "the encoder's rows are larger than this decoder's --max-message-bytes 65536 allows (a reply of "
        "131087 bytes): send a shorter input, or start the decoder with a larger --max-message-bytes"
    )


async def test_an_embed_request_over_the_decoders_message_cap_is_the_callers_invalid_argument(
    encoder: StandIn, stand_in: tuple[StandIn, RunningServer], tmp_path
) -> None:
    """A picture just under --max-message-bytes fits its Generate call, and its Embed call, a few
    hundred bytes larger, does not: gRPC refused it as RESOURCE_EXHAUSTED "encoder ... is full"."""
    parts = EncoderParts(stand_in[1].address, torch.float32, 64 * 1024, cache_bytes=0, shm_dir=tmp_path)
    try:
        [part], _ = _start(parts, [EncoderPrompt("image", b"p" * (64 * 1024 - 40))])
        with pytest.raises(InvalidArgument) as error:
            await _rows(part)
    finally:
        await parts.close()
    assert error.value.field == "prompt[0].encoder"
    assert re.fullmatch(
        r"its Embed request of \d+ bytes \(the input and the call's own fields\) is larger than this "
        r"decoder's --max-message-bytes 65536 allows: send a smaller input, or start the decoder with a "
        r"larger --max-message-bytes",
        error.value.description,
    )
    assert encoder.num_embeds == 0


@pytest.mark.parametrize(
    ("picture", "rows", "description"),
    [
        (
            b"p" * 40_000,
            None,
            r"its Embed request of \d+ bytes is larger than the encoder's --max-message-bytes 32768 allows",
        ),
        (
            PICTURE,
            torch.ones(1200, HIDDEN_SIZE),  # 37.5 KiB of rows
            r"its rows are larger than the encoder's own --max-message-bytes 32768 allows \(a reply of "
            r"\d+ bytes\)",
        ),
    ],
    ids=["request", "reply"],
)
async def test_a_message_over_the_encoders_own_cap_is_the_callers_invalid_argument_naming_the_encoders(
    picture: bytes, rows: torch.Tensor | None, description: str, tmp_path
) -> None:
    """An encoder with a smaller --max-message-bytes than the decoder's: gRPC refuses the request or
    the reply at the encoder, RESOURCE_EXHAUSTED "SERVER: ... message larger than max", which read
    "encoder ... is full" (a reply grew past it with an encoder's --model-name of 3.5 KB)."""
    servicer = StandIn()
    servicer.gate.set()
    servicer.rows = rows
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_message_bytes=32 * 1024),
        [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    await server.set_serving()
    parts = EncoderParts(server.address, torch.float32, 64 * 1024, cache_bytes=0, shm_dir=tmp_path)
    try:
        [part], _ = _start(parts, [EncoderPrompt("image", picture)])
        with pytest.raises(InvalidArgument) as error:
            await _rows(part)
    finally:
        await parts.close()
        await server.stop(0)
    assert error.value.field == "prompt[0].encoder"
    assert re.fullmatch(
        description + ": send a smaller input, or start the encoder with a larger --max-message-bytes",
        error.value.description,
    )


async def test_an_encoder_silent_past_the_decoders_own_cap_is_unavailable_not_the_callers_deadline(
    encoder: StandIn, parts: EncoderParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung encoder held a caller of a 120 s deadline until the decoder's 60 s cap, then answered
    DEADLINE_EXCEEDED as if the caller's time were spent: UNAVAILABLE says another replica may serve."""
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", 0.3)
    [patient], _ = _start(parts, [_picture()], time_remaining_s=120)
    [unbounded], _ = _start(parts, [EncoderPrompt("image", b"another")])
    [hurried], _ = _start(parts, [EncoderPrompt("image", b"a third")], time_remaining_s=0.2)
    for part in (patient, unbounded):
        with pytest.raises(Unavailable) as unavailable:
            await _rows(part)
        assert str(unavailable.value) == (
            f"prompt[0].encoder: encoder {parts.address} did not answer within 0.3 s"
        )
    with pytest.raises(DeadlineExceeded, match=r"^prompt\[0\]\.encoder: the deadline passed"):
        await _rows(hurried)  # the caller's own deadline: still DEADLINE_EXCEEDED


async def _stand_ins(n: int) -> list[tuple[StandIn, RunningServer]]:
    """`n` stand-ins, each saying its own name as Tandem's encoder does."""
    started = []
    for _ in range(n):
        servicer = StandIn()
        server = await start_server(
            ServerOptions(host="127.0.0.1", port=0),
            [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
        )
        await server.set_serving()
        servicer.replica = replica_name.own_name("127.0.0.1", server.port)
        started.append((servicer, server))
    return started


async def test_of_encoders_balanced_a_hung_or_failing_one_is_named_alone_not_the_whole_list(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """`--encoder a,b`: "encoder a,b did not answer within 60 s" (or "is unavailable") left the operator
    to find which of n replicas was at fault; the one that took the call says its name as it begins."""
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", 0.3)
    stand_ins = await _stand_ins(2)
    addresses = [server.address for _, server in stand_ins]
    parts = EncoderParts(",".join(addresses), torch.float32, 1 << 20, cache_bytes=0, shm_dir=tmp_path)
    try:
        # The gate shut: each Embed hangs.
        hung, _ = _start(parts, [EncoderPrompt("image", f"p{i}".encode()) for i in range(4)])
        hung_errors = [await asyncio.gather(_rows(part), return_exceptions=True) for part in hung]
        for servicer, _ in stand_ins:
            servicer.failure = grpc.StatusCode.INTERNAL
            servicer.gate.set()
        failing, _ = _start(parts, [EncoderPrompt("image", f"q{i}".encode()) for i in range(4)])
        failing_errors = [await asyncio.gather(_rows(part), return_exceptions=True) for part in failing]
    finally:
        await parts.close()
        for _, server in stand_ins:
            await server.stop(0)
    for i, [error] in enumerate(hung_errors):
        assert isinstance(error, Unavailable)
        assert str(error) in {
            f"prompt[{i}].encoder: encoder {address} did not answer within 0.3 s" for address in addresses
        }
    for i, [error] in enumerate(failing_errors):
        assert isinstance(error, Unavailable)
        assert str(error) in {
            f"prompt[{i}].encoder: encoder {address} is unavailable (INTERNAL: out of order)"
            for address in addresses
        }
    # Both replicas took calls, and each error named its own: the balancing is unchanged.
    assert all(servicer.num_embeds >= 1 for servicer, _ in stand_ins)


async def test_parts_asking_a_silent_encoder_its_model_share_one_call_and_each_answers_at_its_own_time(
    encoder: StandIn, parts: EncoderParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder that did not answer at start-up is asked its model's name at the first part. Each
    part asked in turn under a lock held for the whole call, with its time counted from before it
    waited: with a hung encoder the k-th of 4 parts answered at 4 times the cap (60 s each)."""
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", 0.3)
    encoder.is_info_hung = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    unbounded = [_start(parts, [EncoderPrompt("image", bytes([i]))])[0][0] for i in range(4)]
    [hurried], _ = _start(parts, [EncoderPrompt("image", b"hurried")], time_remaining_s=0.1)

    async def answered(part: EncoderPrompt) -> tuple[str, float]:
        with pytest.raises((Unavailable, DeadlineExceeded)) as error:
            await _rows(part)
        return str(error.value), loop.time() - started

    *silent, (hurried_error, hurried_s) = await asyncio.gather(*map(answered, [*unbounded, hurried]))
    assert hurried_error == (
        f"prompt[0].encoder: the deadline passed while encoder {parts.address} asked which model it serves"
    )
    assert hurried_s < 0.25
    for error, answered_s in silent:
        assert error == f"prompt[0].encoder: encoder {parts.address} did not answer within 0.3 s"
        assert answered_s < 0.55
    assert encoder.num_infos == 1
    await _until(lambda: encoder.num_infos_cancelled == 1)  # nobody waits for it: not left running


async def test_callers_with_other_tokens_fetch_apart_and_get_only_their_own_refusal(
    encoder: StandIn, parts: EncoderParts
) -> None:
    encoder.refused_token = "Bearer mallory"
    [alice], _ = _start(parts, [_picture()], token="alice")
    [again], _ = _start(parts, [_picture()], token="alice")
    [mallory], _ = _start(parts, [_picture()], token="mallory")
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    assert torch.equal(await _rows(alice), await _rows(again))
    with pytest.raises(InvalidArgument, match="not a picture"):
        await _rows(mallory)
    assert encoder.num_embeds == 2


async def test_a_fetch_past_its_first_callers_deadline_is_fetched_again_by_one_with_time_left(
    encoder: StandIn, parts: EncoderParts
) -> None:
    [hurried], _ = _start(parts, [_picture()], time_remaining_s=0.5)
    await asyncio.sleep(SETTLE_S)
    [patient], _ = _start(parts, [_picture()], time_remaining_s=30)
    with pytest.raises(DeadlineExceeded, match=r"^prompt\[0\]\.encoder: the deadline passed"):
        await _rows(hurried)
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    assert torch.equal(await _rows(patient), _rows_of(PICTURE))
    assert encoder.num_embeds == 2 and encoder.max_running == 1  # the second only once the first ended


async def test_embed_calls_in_flight_are_bounded_and_the_rest_wait_their_turn_within_their_deadline(
    encoder: StandIn, parts: EncoderParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A gRPC server cancels at random the calls past the first 1,000 it has not taken up yet: one
    # request of 2,000 encoder parts failed UNAVAILABLE "CANCELLED" from a healthy encoder.
    pictures = [EncoderPrompt("image", PICTURE + bytes([i])) for i in range(MAX_EMBEDS_IN_FLIGHT + 8)]
    waiting = []  # the pictures over calls of MAX_FETCHES_PER_CALL parts, each held to its share
    for first in range(0, len(pictures), MAX_FETCHES_PER_CALL):
        waiting += _start(parts, pictures[first : first + MAX_FETCHES_PER_CALL])[0]
    await _until(lambda: encoder.num_running >= MAX_EMBEDS_IN_FLIGHT)
    await asyncio.sleep(SETTLE_S)
    assert encoder.num_running == encoder.max_running == MAX_EMBEDS_IN_FLIGHT
    # Never sent: every place is held by a call the encoder holds. It read "encoder ... did not answer".
    limit = f"this decoder's limit of {MAX_EMBEDS_IN_FLIGHT} Embed calls in flight"
    held = f"encoder {parts.address} holds them all, so this part's was never sent"
    [hurried], _ = _start(parts, [EncoderPrompt("image", b"another")], time_remaining_s=0.2)
    with pytest.raises(DeadlineExceeded) as deadline:
        await _rows(hurried)
    assert str(deadline.value) == f"prompt[0].encoder: the deadline passed while {limit} was full ({held})"
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", 0.2)
    [unbounded], _ = _start(parts, [EncoderPrompt("image", b"a third")])
    with pytest.raises(Unavailable) as unavailable:
        await _rows(unbounded)
    assert str(unavailable.value) == f"prompt[0].encoder: {limit} was full for 0.2 s ({held})"
    encoder.gate.set()
    for part in waiting:
        assert torch.equal(await _rows(part), _rows_of(part.content))  # type: ignore[arg-type]
    assert encoder.num_embeds == len(pictures) and encoder.max_running == MAX_EMBEDS_IN_FLIGHT


async def test_one_call_fetches_its_share_of_parts_at_once_so_a_small_call_behind_it_is_not_starved(
    encoder: StandIn, parts: EncoderParts
) -> None:
    """The calls in flight are handed out first come, first served: one call of hundreds of pictures
    held all of them and queued the rest ahead of a one-picture call, which waited or ran out of time."""
    pictures = [EncoderPrompt("image", PICTURE + bytes([i])) for i in range(MAX_EMBEDS_IN_FLIGHT * 2)]
    many, _ = _start(parts, pictures)
    await _until(lambda: encoder.num_running >= MAX_FETCHES_PER_CALL)
    await asyncio.sleep(SETTLE_S)
    assert encoder.num_running == MAX_FETCHES_PER_CALL  # the call's others wait, holding nothing
    [small], _ = _start(parts, [EncoderPrompt("image", b"another")], time_remaining_s=5)
    await _until(lambda: encoder.num_running == MAX_FETCHES_PER_CALL + 1)  # taken up at once
    encoder.gate.set()
    assert torch.equal(await _rows(small), _rows_of(b"another"))
    for part in many:
        assert torch.equal(await _rows(part), _rows_of(part.content))  # type: ignore[arg-type]
    assert encoder.max_running == MAX_FETCHES_PER_CALL + 1 and encoder.num_embeds == len(pictures) + 1


async def test_a_part_waiting_for_its_calls_share_past_the_deadline_gets_deadline_exceeded(
    encoder: StandIn, parts: EncoderParts
) -> None:
    pictures = [EncoderPrompt("image", PICTURE + bytes([i])) for i in range(MAX_FETCHES_PER_CALL + 1)]
    waiting, _ = _start(parts, pictures, time_remaining_s=0.3)
    with pytest.raises(DeadlineExceeded, match=r"other encoder parts were fetched \(16 at a time\)"):
        await _rows(waiting[-1])
    assert encoder.max_running == MAX_FETCHES_PER_CALL


async def test_the_callers_trace_context_reaches_the_encoder_only_when_well_formed(
    encoder: StandIn, parts: EncoderParts
) -> None:
    encoder.gate.set()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    cases = [
        ([("traceparent", parent), ("tracestate", "a=1")], {"traceparent": parent, "tracestate": "a=1"}),
        # 17 KB, over gRPC's hard 16 KiB metadata bound: passed on, the fetch failed as 'encoder is full'
        ([("traceparent", parent), ("tracestate", "k=" + "v" * 17_000)], {"traceparent": parent}),
        ([("traceparent", "00-" + "a" * 7000), ("tracestate", "a=1")], {}),  # malformed: neither
    ]
    for i, (metadata, seen) in enumerate(cases):
        picture = EncoderPrompt("image", PICTURE + bytes([i]))  # a new one each: none comes from the cache
        spec, _ = parts.start(GenerateSpec(prompt=[picture]), metadata, None)
        (part,) = spec.prompt
        assert isinstance(part, EncoderPrompt)
        assert (await _rows(part)).shape == (3, HIDDEN_SIZE)
        assert encoder.trace_headers[-1] == seen


@pytest.mark.parametrize(
    ("embedder", "counts"), [("lookup", True), ("soft-prompt", True), ("projector", False)]
)
async def test_rows_are_asked_unpooled_and_a_part_counts_as_its_input_only_under_the_decoders_tokenizer(
    encoder: StandIn, parts: EncoderParts, embedder: str, counts: bool
) -> None:
    """Left unset, the pooling was the encoder's --pooling (mean: one row whatever the input); a
    projector tokenizes with its own vocabulary. A part started before the encoder said which embedder
    it runs counts at one."""
    encoder.embedder = embedder
    encoder.gate.set()
    [before], _ = _start(parts, [_picture()])
    await _rows(before)
    [after], _ = _start(parts, [EncoderPrompt("image", b"another picture")])
    await _rows(after)
    assert not before.counts_as_input and after.counts_as_input is counts
    assert encoder.poolings == [encoder_pb2.POOLING_NONE] * 2


async def test_a_prompt_its_sizes_rule_out_is_refused_before_any_part_is_fetched(
    encoder: StandIn, parts: EncoderParts
) -> None:
    """`check` is handed the call's parts counted as the encoder will embed them, before any fetch
    starts: a part of 100,000 token IDs reached the encoder, its rows made, before the context
    refused it."""
    encoder.embedder = "lookup"
    encoder.gate.set()
    [first], _ = _start(parts, [_picture()])
    await _rows(first)  # the encoder has said which embedder it runs
    seen: list[GenerateSpec] = []

    def refuse(spec: GenerateSpec) -> None:
        seen.append(spec)
        raise InvalidArgument("prompt", "too long")

    ids = EncoderPrompt("token_ids", range(100_000))
    with pytest.raises(InvalidArgument, match="too long"):
        parts.start(GenerateSpec(prompt=[TextPrompt("a"), ids]), None, None, check=refuse)
    _, counted = seen[0].prompt
    assert isinstance(counted, EncoderPrompt) and counted.counts_as_input
    assert counted.rows is not None and not counted.rows.done()  # its fetch never started
    await asyncio.sleep(SETTLE_S)
    assert encoder.num_embeds == 1 and parts.fetches.num_started == 1
    # A call without encoder parts is not checked here: the engine's own check is enough.
    assert parts.start(GenerateSpec(prompt=[TextPrompt("a")]), None, None, check=refuse)[1] == []
    assert len(seen) == 1


def _parts_of_no_encoder(tmp_path: Path) -> tuple[str, EncoderParts]:
    """An address nothing listens on (a port of this worker's slice, free now), and parts asking it."""
    address = f"127.0.0.1:{free_port()}"
    return address, EncoderParts(
        address, torch.float32, 1 << 20, cache_bytes=0, shm_dir=tmp_path, hidden_size=HIDDEN_SIZE
    )


async def test_an_encoder_gRPC_cannot_reach_is_said_in_fixed_words_and_gRPCs_are_logged(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """gRPC's own UNAVAILABLE (no status of the encoder's) went on as "is unavailable (UNAVAILABLE:
    failed to connect to all addresses; last error: ... ipv4:10.0.0.3:50051 ...)", gRPC's terms and
    the internal address, which the gateway passes on to HTTP callers unchanged (it carries the
    decoder's status)."""
    address, parts = _parts_of_no_encoder(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger=encoder_parts.__name__):
            [part], _ = _start(parts, [_picture()])
            with pytest.raises(Unavailable) as error:
                await asyncio.wait_for(asyncio.wrap_future(part.rows), 30)
    finally:
        await parts.close()
    assert str(error.value) == (
        f"prompt[0].encoder: encoder {address} could not be reached (no connection, or it was lost)"
    )
    assert f"an Embed call to encoder {address} failed: UNAVAILABLE: " in caplog.text


async def test_a_request_of_five_parts_with_no_encoder_listening_logs_one_warning_line(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """`_error` runs once for each part waiting on a failed call: a stopped encoder wrote one identical
    WARNING line per part, N for a request of N parts. gRPC's own failures are logged once in a while
    for each encoder and code, as the gateway logs them."""
    address, parts = _parts_of_no_encoder(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger=encoder_parts.__name__):
            five, _ = _start(parts, [EncoderPrompt("image", f"p{i}".encode()) for i in range(5)])
            for part in five:
                with pytest.raises(Unavailable, match="could not be reached"):
                    await asyncio.wait_for(asyncio.wrap_future(part.rows), 30)
    finally:
        await parts.close()
    assert len(five) == 5
    assert [r.getMessage().split(": UNAVAILABLE: ")[0] for r in caplog.records] == [
        f"an Embed call to encoder {address} failed"
    ]


async def test_an_encoders_own_unavailable_keeps_its_words(encoder: StandIn, parts: EncoderParts) -> None:
    """An UNAVAILABLE the encoder sent (its status with it: still loading, shutting down) is its own
    word on why, passed on as it said it."""
    encoder.refusal = Unavailable("the encoder is still loading its model")
    encoder.gate.set()
    [part], _ = _start(parts, [_picture()])
    with pytest.raises(Unavailable) as error:
        await _rows(part)
    assert str(error.value) == (
        f"prompt[0].encoder: encoder {parts.address} is unavailable "
        "(UNAVAILABLE: the encoder is still loading its model)"
    )
