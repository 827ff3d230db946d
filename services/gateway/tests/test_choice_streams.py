"""A request's Generate streams as one, against a decoder over gRPC: every choice's events arrive,
the first failure (a refusal before any event, or an error later) names its choice, and closing
cancels every call still open, so no decoder stream outlives its request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.choice_streams import ChoiceFailed, ChoiceStreams
from tandem.gateway.choices import choices_of
from tandem.gateway.completion_request import completion_request
from tandem.gateway.errors import BodyNames

from .fake_decoder import FakeDecoder, fake_decoder

LIMITS = BodyLimits.for_completions(256, 16)


@contextlib.asynccontextmanager
async def _streams(body: dict) -> AsyncIterator[tuple[ChoiceStreams, FakeDecoder]]:
    """`body`'s choices on the fake decoder, closed afterwards as the gateway always closes them."""
    async with fake_decoder() as (decoder, address), grpc.aio.insecure_channel(address) as channel:
        choices = choices_of(completion_request(body, LIMITS), "r")
        streams = ChoiceStreams(decoder_pb2_grpc.DecoderStub(channel), choices, None)
        try:
            yield streams, decoder
        finally:
            streams.close()
            await decoder.wait_until_none_open()


async def _events(streams: ChoiceStreams) -> list[tuple[int, decoder_pb2.GenerateResponse]]:
    return [(choice.index, event) async for choice, event in streams.events()]


async def test_every_choices_events_arrive_each_ending_with_its_finish() -> None:
    async with _streams({"prompt": ["a", "b"], "n": 2, "seed": 1, "max_tokens": 2}) as (streams, decoder):
        await streams.start()
        events = await _events(streams)
    texts: dict[int, str] = {}
    for index, event in events:
        assert index not in texts or not texts[index].endswith("|")  # nothing after a choice's finish
        if event.HasField("delta"):
            texts[index] = texts.get(index, "") + event.delta.text
        elif event.HasField("finished"):
            texts[index] += "|"
    assert texts == {0: "<a> seed=1|", 1: "<a> seed=2|", 2: "<b> seed=1|", 3: "<b> seed=2|"}
    assert decoder.cancelled == []


async def test_a_refused_choice_fails_the_start_and_closing_cancels_its_accepted_neighbours() -> None:
    async with _streams({"prompt": ["x hang", "y hang", "after2 refuse"]}) as (streams, decoder):
        with pytest.raises(ChoiceFailed) as failed:
            await streams.start()
        assert failed.value.choice.prompt_index == 2
        error = failed.value.http_error(BodyNames(), is_batch=True)
        assert (error.status, error.param) == (400, "prompt[2]") and error.message.startswith("prompt[2]: ")
        streams.close()
        await decoder.wait_until_none_open()
        assert sorted(decoder.cancelled) == ["r-0", "r-1"]


async def test_a_choice_that_fails_mid_stream_fails_the_events_and_its_neighbours_are_cancelled() -> None:
    async with _streams({"prompt": ["hang", "break"]}) as (streams, decoder):
        await streams.start()
        seen = []
        with pytest.raises(ChoiceFailed) as failed:
            async for choice, _ in streams.events():
                seen.append(choice.index)
        assert (
            failed.value.choice.index == 1 and failed.value.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert 0 in seen and 1 in seen  # both streamed before the failure
        streams.close()
        await decoder.wait_until_none_open()
        assert decoder.cancelled == ["r-0"]


async def test_closing_mid_stream_cancels_every_call() -> None:
    async with _streams({"prompt": "hang", "n": 3}) as (streams, decoder):
        await streams.start()
        seen: set[int] = set()
        async for choice, _ in streams.events():
            seen.add(choice.index)
            if len(seen) == 3:
                break
        assert decoder.num_open == 3
        streams.close()
        await decoder.wait_until_none_open()
        assert sorted(decoder.cancelled) == ["r-0", "r-1", "r-2"]
