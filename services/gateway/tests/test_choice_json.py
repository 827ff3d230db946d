"""A choice of a non-streamed answer serialized a slice at a time is, byte for byte, the JSON the
choice dumped whole is (chat's and completions' shapes, many slices or none, text json.dumps escapes,
tokens spelled by their IDs), every byte told to the caller's counter, and the event loop runs between
the slices."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway import choice_json
from tandem.gateway.responses import Completion


@asynccontextmanager
async def _ticking() -> AsyncIterator[list[int]]:
    """A list that grows by one each time the event loop runs a task, while the block runs."""
    ticks: list[int] = []

    async def ticker() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    ticking = asyncio.ensure_future(ticker())
    try:
        yield ticks
    finally:
        ticking.cancel()


def _completion(kind: str, num_tokens: int, top: int, texts: tuple[str, ...] = (" tok",)) -> Completion:
    """A finished choice of `num_tokens` deltas with `top` alternatives each, its texts taken in turn."""
    completion = Completion(kind, "id", "model", index=2, created=1)
    for k in range(num_tokens):
        delta = decoder_pb2.TokenDelta(text=texts[k % len(texts)], token_ids=[k], logprobs=[-0.1 * k])
        alternatives = delta.top_logprobs.add()
        alternatives.token_ids.extend(range(100, 100 + top))
        alternatives.logprobs.extend([-1.0 / (j + 3) for j in range(top)])
        completion.add(delta, with_logprobs=True)
    completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_LENGTH)
    return completion


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
async def test_a_choice_in_slices_is_the_json_of_the_choice_dumped_whole(
    kind: str, num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(choice_json, "SLICE_VALUES", 16)  # 300 tokens of 4 values: 75 slices
    # escaped, empty (spelled token_id:N), the marker, a text that reads as the token_id:N spelling
    texts = (" tok", 'é\n"', "", "\x00tandem-logprobs\x00", "🙂", "token_id:7")
    completion = _completion(kind, num_tokens, top=3, texts=texts)
    for with_logprobs in (True, False):
        counted: list[int] = []
        pieces = await choice_json.choice_json(completion, with_logprobs, counted.append)
        assert b"".join(pieces) == json.dumps(completion.choice(with_logprobs)).encode()
        assert sum(counted) == sum(map(len, pieces))  # every byte held is counted


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("num_positions", [2, 100])
async def test_a_choice_with_prompt_logprobs_in_slices_is_the_choice_dumped_whole(
    kind: str, num_positions: int
) -> None:
    # A completions choice holds them as its last key; a chat answer, not its choice (`answers.write`).
    completion = _completion(kind, 3, top=2, texts=("\x00tandem-logprobs\x00",))
    first = decoder_pb2.TokenDelta(text="", token_ids=[9])
    top = decoder_pb2.TopLogprobs(token_ids=[1, 2], logprobs=[-0.5, -1.0], token_bytes=[b"}", b'", '])
    first.prompt_logprobs.extend(
        decoder_pb2.PromptLogprob(token_id=p, logprob=-p, token_bytes=b"]", top_logprobs=top)
        for p in range(num_positions)
    )
    completion.add(first, with_logprobs=True)
    for with_logprobs in (True, False):
        counted: list[int] = []
        pieces = await choice_json.choice_json(completion, with_logprobs, counted.append)
        whole = completion.choice(with_logprobs)
        assert b"".join(pieces) == json.dumps(whole).encode()
        assert ("prompt_logprobs" in whole) is (kind == "text")
        assert sum(counted) == sum(map(len, pieces))


async def test_a_choice_in_slices_counts_offsets_into_its_text_as_the_choice_does() -> None:
    # A SentencePiece first token whose space the decoder's text dropped: b" Hello" of text "Hello".
    completion = Completion("text", "id", "model", index=0, created=1)
    for text, own in (("Hello", b" Hello"), (" world", b" world")):
        delta = decoder_pb2.TokenDelta(text=text, token_ids=[1], logprobs=[-0.5], token_bytes=[own])
        completion.add(delta, with_logprobs=True)
    pieces = await choice_json.choice_json(completion, True)
    assert json.loads(b"".join(pieces))["logprobs"]["text_offset"] == [0, 5]


async def test_the_loop_runs_between_the_slices_of_a_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # A choice of 8,192 tokens with 20 alternatives dumped whole held the loop for 1 s (0.43 s of it one
    # json.dumps call, which no thread could have let go of).
    monkeypatch.setattr(choice_json, "SLICE_VALUES", 40)
    completion = _completion("chat", 100, top=19)  # 20 values a token: a slice every 2 tokens
    slices: list[int] = []  # the loop's ticks as each slice is dumped
    dumps = json.dumps
    async with _ticking() as ticks:
        monkeypatch.setattr(
            choice_json.json,
            "dumps",
            lambda v: (isinstance(v, list) and slices.append(len(ticks))) or dumps(v),
        )
        await choice_json.choice_json(completion, True)
    assert len(slices) == 50 and all(a < b for a, b in zip(slices, slices[1:], strict=False))


async def test_the_loop_runs_after_a_choice_without_logprobs() -> None:
    # Its text is one dump, but 16 choices of 131,072 CJK characters each are 76 ms of them in a row.
    async with _ticking() as ticks:
        await asyncio.sleep(0)  # the ticker's first tick
        before = len(ticks)
        await choice_json.choice_json(_completion("chat", 3, top=0), False)
        assert len(ticks) > before
