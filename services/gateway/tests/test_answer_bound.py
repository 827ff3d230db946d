"""The most bytes a non-streamed answer's JSON takes, counted from its decoded tokens: never under the
JSON the gateway writes, whatever the tokens' text (escaped, multi-byte, control characters, a long
token repeated as logit_bias can force), 10-digit token IDs, float32's longest logprobs, missing or
odd logprobs, chat's and completions' shapes, with and without logprobs, tokens spelled by their own
bytes (part of a character, control bytes, invalid UTF-8) or, from an older decoder, by ID."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway import answer_bound
from tandem.gateway.answer_bound import CHOICE_FRAME_BYTES, _num_escaped, _num_joined_escaped
from tandem.gateway.logprob_entries import token_text
from tandem.gateway.responses import Completion, answer, answer_frame, share_scores

LONGEST_LOGPROB = -1.0649640863824063e-32  # float32's, 23 characters as JSON
TEXTS = ("", "a", '"', "\\", "\n\t\x01\x1f", "é", "\U0001f600", "\u2028", "日本", "token_id:7", "], ")
LOGPROBS = (0.0, -0.0, -1.5, -1e-320, float("nan"), float("-inf"), float("inf"), -9999.0, -1e308, 3.0)
# Tokens logit_bias can force, repeated: the longest JSON a byte (control bytes) and a long run.
FORCED = ("\x01" * 16, " " * 81, "\U0001f600" * 4)
# A token's own bytes: each JSON escape, a character's first and last bytes alone, bytes no UTF-8 holds.
TOKEN_BYTES = (
    b"",
    b"a",
    b'"\\',
    b"\x01\x1f\n",
    "é".encode(),
    b"\xf0\x9f",
    b"\x98\x80",
    b"\xff" * 4,
    "\u2028日".encode(),
)
# Bytes a decoder never should send but a tokenizer's byte tokens can: NUL (the join's own separator),
# lone lead and continuation bytes, overlong forms, UTF-16 surrogates, past U+10FFFF, characters cut short.
ADVERSARIAL_BYTES = (
    b"\x00",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe6\x88",
    b"\x88",
    b"\xff",
)


def _json_bytes(completion: Completion, with_logprobs: bool) -> int:
    return len(json.dumps(completion.choice(with_logprobs)).encode()) + len(", ")


def _delta(rng: random.Random, top: int) -> decoder_pb2.TokenDelta:
    num_tokens = rng.choice([0, 1, 1, 2, 5])
    delta = decoder_pb2.TokenDelta(text="".join(rng.choices(TEXTS, k=rng.choice([1, 1, 3]))))
    delta.token_ids.extend(rng.randrange(2**32) for _ in range(num_tokens))
    delta.logprobs.extend(rng.choice(LOGPROBS + (rng.uniform(-30, 0),)) for _ in range(num_tokens))
    is_spelled = rng.random() < 0.5  # else an older decoder's, without bytes
    if is_spelled:
        delta.token_bytes.extend(rng.choice(TOKEN_BYTES) * rng.choice([1, 1, 8]) for _ in range(num_tokens))
    for _ in range(rng.randrange(num_tokens + 1)):
        alternatives = delta.top_logprobs.add()
        num_top = rng.choice([top, rng.randrange(21)])
        alternatives.token_ids.extend(rng.randrange(2**32) for _ in range(num_top))
        alternatives.logprobs.extend(rng.uniform(-30, 0) for _ in range(num_top))
        if is_spelled:
            alternatives.token_bytes.extend(rng.choice(TOKEN_BYTES) for _ in range(num_top))
    return delta


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_the_bound_is_never_under_the_json_of_random_tokens(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(200):
        completion = Completion(kind, "rid", "m", rng.randrange(2**31), 0, 2**31)
        top = rng.randrange(21)
        for _ in range(rng.choice([0, 1, 10, 50])):
            completion.add(_delta(rng, top), True)
        completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_CONTEXT_LIMIT)
        for with_logprobs in (True, False):  # added with logprobs, bounded for both shapes
            assert completion.json_bound >= _json_bytes(completion, with_logprobs)


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("top", [None, 0, 20])
@pytest.mark.parametrize("text", FORCED)
def test_a_token_forced_again_and_again_stays_within_the_bound(kind: str, top: int | None, text: str) -> None:
    completion = Completion(kind, "f" * 32, "model", 2**31, 0, 2**31)
    for k in range(500):
        delta = decoder_pb2.TokenDelta(text=text, token_ids=[2**32 - 1 - k])
        if top is not None:
            delta.logprobs.append(LONGEST_LOGPROB)
            alternatives = delta.top_logprobs.add()
            alternatives.token_ids.extend(2**32 - 1 - j for j in range(top))
            alternatives.logprobs.extend([LONGEST_LOGPROB] * top)
        completion.add(delta, top is not None)
    completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_CONTEXT_LIMIT)
    real = _json_bytes(completion, top is not None)
    assert real <= completion.json_bound <= 3 * real  # an upper bound, and not a loose one


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_tokens_that_are_parts_of_characters_stay_within_the_bound(kind: str) -> None:
    # The completions shape spells each "bytes:\\xf0\\x9f\\x98" (21 characters), chat "\\ufffd" (6).
    completion = Completion(kind, "f" * 32, "model", 2**31, 0, 2**31)
    for k in range(500):
        delta = decoder_pb2.TokenDelta(text="", token_ids=[k], logprobs=[LONGEST_LOGPROB])
        delta.token_bytes.append(b"\xf0\x9f\x98")
        alternatives = delta.top_logprobs.add(token_ids=[1, 2], logprobs=[LONGEST_LOGPROB] * 2)
        alternatives.token_bytes.extend([b"\xf0\x9f\x98", b"\xe6\x88"])
        completion.add(delta, True)
    completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_CONTEXT_LIMIT)
    assert completion.json_bound >= _json_bytes(completion, True)


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_delta_with_fewer_byte_strings_than_tokens_stays_within_the_bound(kind: str) -> None:
    # Spelled as an older decoder's (its first token by the delta's text, the rest by ID): the bound
    # counted its bytes instead (chat: bound 153,856, JSON 244,376).
    completion = Completion(kind, "f" * 32, "model", 2**31, 0, 2**31)
    for _ in range(50):
        delta = decoder_pb2.TokenDelta(text="\x01" * 200, token_ids=[2**32 - 1, 2**32 - 2])
        delta.logprobs.extend([LONGEST_LOGPROB] * 2)
        delta.token_bytes.append(b"")
        alternatives = delta.top_logprobs.add(token_ids=[2**32 - 1] * 20, logprobs=[LONGEST_LOGPROB] * 20)
        alternatives.token_bytes.append(b"")
        completion.add(delta, True)
    completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_CONTEXT_LIMIT)
    assert completion.json_bound >= _json_bytes(completion, True)


def test_an_answers_bound_is_its_frame_and_its_choices_bounds() -> None:
    completions = [Completion("chat", "rid", "m", i, 0, 1) for i in range(3)]
    for completion in completions:
        completion.add(decoder_pb2.TokenDelta(text="hi", token_ids=[1], logprobs=[-1.0]), True)
        completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_EOS)
    assert completions[0].json_bound == CHOICE_FRAME_BYTES + 2 + 105 + 2 + 5 * 2
    before, after = answer_frame(completions)
    bound = len(before) + len(after) + sum(c.json_bound for c in completions)
    assert bound >= len(json.dumps(answer(completions, True)).encode())


def _scored(rng: random.Random, num_positions: int, top: int) -> decoder_pb2.TokenDelta:
    """A delta with prompt logprobs: embedding rows, tokens with and without bytes, ranked or not."""
    delta = decoder_pb2.TokenDelta()
    for _ in range(num_positions):
        position = delta.prompt_logprobs.add()
        if rng.random() < 0.9:
            position.token_id = rng.choice([2**32 - 1, rng.randrange(2**32)])
            position.logprob = rng.choice(LOGPROBS + (LONGEST_LOGPROB,))
            if rng.random() < 0.8:
                position.token_bytes = rng.choice(TOKEN_BYTES + ADVERSARIAL_BYTES) * rng.choice([1, 8])
        ids = [rng.choice([position.token_id, 2**32 - 2 - k]) for k in range(top)]
        position.top_logprobs.token_ids.extend(ids)
        position.top_logprobs.logprobs.extend(rng.choice(LOGPROBS + (LONGEST_LOGPROB,)) for _ in ids)
        if rng.random() < 0.8:
            position.top_logprobs.token_bytes.extend(rng.choice(TOKEN_BYTES + ADVERSARIAL_BYTES) for _ in ids)
    return delta


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_the_bound_is_never_under_the_json_of_random_prompt_logprobs(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(50):
        completions = [Completion(kind, "rid", "m", i, i // 2, 2**31) for i in range(3)]
        top = rng.choice([0, 1, 20])
        for k, positions, with_logprobs in ((0, [1, 2, 30], rng.random() < 0.5), (2, [1, 30], True)):
            completions[k].add(scored := _scored(rng, rng.choice(positions), top), with_logprobs)
            await completions[k].bound_scores(scored)
        for completion in completions:
            completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_LENGTH)
        share_scores(completions)  # choice 1 shows prompt 0's too (a completion's; a chat's once)
        before, after = answer_frame(completions, with_scores=False)  # the frame `answers.write` counts
        bound = len(before) + len(after) + sum(c.json_bound for c in completions)
        assert bound >= len(json.dumps(answer(completions, True)).encode())


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("token_bytes", [None, b"\x01" * 8])
async def test_prompt_logprobs_of_the_longest_entries_stay_within_a_close_bound(
    kind: str, token_bytes: bytes | None
) -> None:
    # 10-digit IDs, float32's longest logprob, the prompt's token unranked (below its top 20).
    delta = decoder_pb2.TokenDelta()
    for _ in range(500):
        position = delta.prompt_logprobs.add(token_id=2**32 - 1, logprob=LONGEST_LOGPROB)
        ids = [2**32 - 2 - k for k in range(20)]
        position.top_logprobs.token_ids.extend(ids)
        position.top_logprobs.logprobs.extend([LONGEST_LOGPROB] * 20)
        if token_bytes is not None:
            position.token_bytes = token_bytes
            position.top_logprobs.token_bytes.extend([token_bytes] * 20)
    completion = Completion(kind, "rid", "m", 0, 0, 2**31)
    completion.add(delta, False)
    await completion.bound_scores(delta)
    real = len(json.dumps(answer([completion], False)).encode())
    before, after = answer_frame([completion], with_scores=False)
    assert real <= len(before) + len(after) + completion.json_bound <= 1.05 * real  # ranks 1-20, not null


def test_texts_counted_together_take_what_each_takes_alone() -> None:
    rng = random.Random(0)
    pieces = TOKEN_BYTES + ADVERSARIAL_BYTES
    for _ in range(300):
        texts = [b"".join(rng.choices(pieces, k=rng.randrange(4))) for _ in range(rng.randrange(1, 30))]
        texts += [bytes(rng.randrange(256) for _ in range(rng.randrange(6))) for _ in range(5)]
        rng.shuffle(texts)
        assert _num_joined_escaped(texts) == sum(_num_escaped(token_text(t)) for t in texts), texts
    assert _num_joined_escaped([]) == 0


async def test_a_prompts_bound_lets_the_loop_go_between_slices_of_positions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Counted in one go, 8,192 positions of 21 entries held the loop 74-140 ms, a neighbour's stream 296 ms.
    delta = _scored(random.Random(1), 18, top=20)
    whole = await answer_bound.prompt_bound(delta)
    monkeypatch.setattr(answer_bound, "SLICE_POSITIONS", 4)
    ticks: list[int] = []  # grows each time the loop runs the ticker
    counted: list[int] = []  # the ticks as each slice is counted

    async def ticker() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    slice_bound = answer_bound._slice_bound
    monkeypatch.setattr(answer_bound, "_slice_bound", lambda p: counted.append(len(ticks)) or slice_bound(p))
    ticking = asyncio.ensure_future(ticker())
    try:
        assert await answer_bound.prompt_bound(delta) == whole
    finally:
        ticking.cancel()
    assert len(counted) == 5 and all(a < b for a, b in zip(counted, counted[1:], strict=False))
