"""DecoderServicer.Generate against a stand-in engine: a delta carrying prompt logprobs is built off the
event loop, in the stream's order; the engine is told the most bytes a reply may take. And the bound on
new tokens its span records."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import torch

from tandem.client import telemetry as otel
from tandem.client.errors import FailedPrecondition, InvalidArgument, TandemError
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2
from tandem.common.torch_part import tensors
from tandem.decoder.api import protocol
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.api.servicer import DecoderServicer, _request_attributes
from tandem.decoder.engine.admission.prompt import GenerateSpec, check_spec
from tandem.decoder.engine.outputs.outputs import Accepted, Delta, Event, Finished, FinishReason
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprob
from tandem.decoder.engine.outputs.token_bytes import TokenBytes

MAX_MESSAGE_BYTES = 12_345
SCORED = Delta("r", (4,), "d", (), (), prompt_logprobs=(PromptLogprob(3, None, (), ()),))
EVENTS: tuple[Event, ...] = (
    Accepted("r", 1),
    SCORED,
    Delta("r", (5,), "e", (), ()),
    Finished("r", FinishReason.LENGTH, None, None, 1, 2, 0, 0.0, 0.0, 0.0),
)


class StandInEngine:
    is_healthy = True
    max_model_len = 100
    max_token_chars = 4
    token_bytes = TokenBytes((b"a",) * 10)
    hidden_size = 4
    enable_prompt_embeds = True
    has_chat_template = True

    def __init__(self) -> None:
        self.specs: list[GenerateSpec] = []

    def check_spec(self, spec: GenerateSpec) -> None:
        check_spec(
            spec,
            vocab_size=10,  # as token_bytes
            hidden_size=self.hidden_size,
            max_model_len=self.max_model_len,
            enable_prompt_embeds=self.enable_prompt_embeds,
            has_chat_template=self.has_chat_template,
            has_structured=True,
            max_token_chars=self.max_token_chars,
        )

    def stream(self, spec: GenerateSpec) -> AsyncIterator[Event]:
        self.specs.append(spec)
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        for event in EVENTS:
            yield event


class Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float | None:
        return None


def _request() -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest(
        prompt=[decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[3]))]
    )
    request.output.prompt_logprobs = 1
    return request


async def _replies(decoder: DecoderServicer) -> list[decoder_pb2.GenerateResponse]:
    return [reply async for reply in decoder.Generate(_request(), Context())]


async def test_a_delta_with_prompt_logprobs_is_built_while_the_loop_serves_others_in_the_streams_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop, built = asyncio.get_running_loop(), []
    to_pb = protocol.event_to_pb

    def event_to_pb(event: Event, token_bytes: TokenBytes | None = None) -> decoder_pb2.GenerateResponse:
        if event is SCORED:  # the loop runs a callback while this one is being built
            served = threading.Event()
            loop.call_soon_threadsafe(served.set)
            built.append(("scored", served.wait(timeout=1.0)))
        else:
            built.append((type(event).__name__, threading.current_thread() is threading.main_thread()))
        return to_pb(event, token_bytes)

    monkeypatch.setattr(protocol, "event_to_pb", event_to_pb)
    replies = await _replies(DecoderServicer("m", MAX_MESSAGE_BYTES, engine=StandInEngine()))
    assert [r.WhichOneof("event") for r in replies] == ["accepted", "delta", "delta", "finished"]
    assert [list(r.delta.token_ids) for r in replies[1:3]] == [[4], [5]]
    assert replies[1].delta.prompt_logprobs[0].token_bytes == b"a"
    # Every other event is built on the loop: a thread's hand-off would cost more than its build.
    assert built == [("Accepted", True), ("scored", True), ("Delta", True), ("Finished", True)]


async def test_a_stream_cancelled_while_its_scored_delta_is_built_ends_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    to_pb = protocol.event_to_pb

    def event_to_pb(event: Event, token_bytes: TokenBytes | None = None) -> decoder_pb2.GenerateResponse:
        if event is SCORED:
            release.wait(timeout=5.0)
        return to_pb(event, token_bytes)

    monkeypatch.setattr(protocol, "event_to_pb", event_to_pb)
    reading = asyncio.ensure_future(_replies(DecoderServicer("m", MAX_MESSAGE_BYTES, engine=StandInEngine())))
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(reading, timeout=1.0)  # the handler leaves; the build finishes alone
    release.set()


async def test_the_engine_is_told_the_most_bytes_a_reply_may_take() -> None:
    engine = StandInEngine()
    await _replies(DecoderServicer("m", MAX_MESSAGE_BYTES, engine=engine))
    assert engine.specs[0].max_reply_bytes == MAX_MESSAGE_BYTES


async def test_an_embedding_tensor_over_two_dimensions_is_refused_from_its_count_before_one_is_read() -> None:
    # A byte a dimension on the wire: 1 million of them were listed, checked and printed whole.
    engine = StandInEngine()
    decoder = DecoderServicer("m", MAX_MESSAGE_BYTES, engine=engine)
    wide = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[1] * 1_000_000 + [4])
    request = decoder_pb2.GenerateRequest(
        prompt=[decoder_pb2.PromptSegment(text="hi"), decoder_pb2.PromptSegment(embeddings=wide)]
    )
    with pytest.raises(InvalidArgument) as caught:
        [reply async for reply in decoder.Generate(request, Context())]
    assert (caught.value.field, caught.value.description) == (
        "prompt[1].embeddings.shape",
        "more than 2 dimensions: [1, 1, 1, 1, ... (1000001 dimensions)]",
    )
    request = decoder_pb2.GenerateRequest()
    request.chat.messages.add(role="user").content.add(image=wide)
    with pytest.raises(InvalidArgument, match=r"^chat\.messages\[0\]\.content\[0\]\.image\.shape: more"):
        [reply async for reply in decoder.Generate(request, Context())]
    assert not engine.specs
    # Two or fewer reach the engine, whose refusal names the hidden size.
    for shape in ([2, 4], [8]):
        rows = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=shape, data=bytes(32))
        request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(embeddings=rows)])
        [reply async for reply in decoder.Generate(request, Context())]
    assert [list(spec.prompt[0].rows.shape) for spec in engine.specs] == [[2, 4], [8]]


async def test_a_prompt_too_long_for_the_context_is_refused_before_its_encoder_parts_are_fetched(
    tmp_path,
) -> None:
    # The fetch started with the call, before the engine's length check: an oversized prompt's encoder
    # parts went to the encoder, which made their rows, before the decoder refused it.
    parts = EncoderParts("127.0.0.1:9", torch.float32, 1 << 20, cache_bytes=0, shm_dir=tmp_path)
    engine = StandInEngine()
    decoder = DecoderServicer("m", MAX_MESSAGE_BYTES, engine=engine, encoder_parts=parts)
    request = decoder_pb2.GenerateRequest(
        prompt=[
            decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[3] * 90)),
            decoder_pb2.PromptSegment(text="x" * 36),  # at least 9 positions at 4 characters a token
            decoder_pb2.PromptSegment(encoder=encoder_pb2.EncoderInput(text="a cat")),  # at least one
        ]
    )
    try:
        with pytest.raises(InvalidArgument) as caught:
            [reply async for reply in decoder.Generate(request, Context())]
    finally:
        await parts.close()
    assert caught.value.field == "prompt"
    assert caught.value.description.startswith("at least 100 positions (")
    assert caught.value.description.endswith(
        "exceed the 99 a prompt may take (max_model_len 100 less one to generate)"
    )
    assert parts.fetches.num_started == 0 and not engine.specs


ENCODER_PART = decoder_pb2.PromptSegment(encoder=encoder_pb2.EncoderInput(text="a cat"))
TOO_LONG = decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[3] * 99))  # with ENCODER_PART: 100


def _rows(shape: list[int]) -> decoder_pb2.PromptSegment:
    rows = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=shape, data=bytes(400 * 4))
    return decoder_pb2.PromptSegment(embeddings=rows)


def _chat(*segments: decoder_pb2.PromptSegment) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest()
    content = request.chat.messages.add(role="user").content
    for segment in segments:
        if segment.HasField("encoder"):
            content.add(encoder=segment.encoder)
        else:
            content.add(token_ids=segment.token_ids)
    return request


def _temperature(value: float) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest(prompt=[ENCODER_PART])
    request.sampling.temperature = value
    return request


@pytest.mark.parametrize(
    ("request_", "settings", "error", "field"),
    [
        # 42842e5's length bound ran first: these 400 floats (a flattened row, or 200 rows of width 2 on
        # a model of 4) were counted as positions and refused as too long for the context.
        (decoder_pb2.GenerateRequest(prompt=[_rows([400]), ENCODER_PART]), {}, InvalidArgument, "prompt[0]"),
        (
            decoder_pb2.GenerateRequest(prompt=[_rows([200, 2]), ENCODER_PART]),
            {},
            InvalidArgument,
            "prompt[0]",
        ),
        (
            decoder_pb2.GenerateRequest(prompt=[TOO_LONG, ENCODER_PART]),
            {"enable_prompt_embeds": False},
            FailedPrecondition,
            "prompt[1].encoder",
        ),
        (_chat(TOO_LONG, ENCODER_PART), {"has_chat_template": False}, FailedPrecondition, "chat"),
        # Only the length bound ran before the fetch: a picture with temperature -1 cost an Embed call
        # (a vision tower run) before its refusal, on every such call.
        (_temperature(-1.0), {}, InvalidArgument, "sampling.temperature"),
    ],
    ids=["rank-1-rows", "rows-of-another-width", "embeddings-off", "no-chat-template", "temperature"],
)
async def test_a_call_the_build_refuses_for_a_rule_that_reads_no_position_is_refused_for_it_before_any_fetch(
    tmp_path, request_: decoder_pb2.GenerateRequest, settings: dict, error: type[TandemError], field: str
) -> None:
    parts = EncoderParts("127.0.0.1:9", torch.float32, 1 << 20, cache_bytes=0, shm_dir=tmp_path)
    engine = StandInEngine()
    for name, value in settings.items():
        setattr(engine, name, value)
    decoder = DecoderServicer("m", MAX_MESSAGE_BYTES, engine=engine, encoder_parts=parts)
    try:
        with pytest.raises(error) as caught:
            [reply async for reply in decoder.Generate(request_, Context())]
    finally:
        await parts.close()
    assert caught.value.field.startswith(field) and "positions" not in caught.value.description
    assert parts.fetches.num_started == 0 and not engine.specs


def test_the_span_records_the_max_tokens_asked_and_none_where_none_was_asked() -> None:
    def max_tokens(**stopping: int | bool) -> object:
        request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text="hi")])
        for name, value in stopping.items():
            setattr(request.stopping, name, value)
        spec = protocol.spec_from_pb(request, tensors.DEFAULT_LIMITS, None)
        return _request_attributes(spec, 0, 1).get(otel.GEN_AI_REQUEST_MAX_TOKENS)

    assert max_tokens(max_new_tokens=5) == 5
    assert max_tokens(max_new_tokens=16, cap_to_context=True) == 16
    assert max_tokens() == 256  # the default's bound, capped to the context at admission
    assert max_tokens(cap_to_context=True) is None  # not the 4294967295 that stands for no bound
