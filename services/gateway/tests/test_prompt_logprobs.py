"""vLLM's `prompt_logprobs` through the gateway: the field bounded as the decoder bounds it and refused
with a stream, as vLLM refuses it; each completions choice with its prompt's scores (every choice of a
prompt, one Generate call of them asking) and a chat answer with its own, in vLLM's shape; the JSON
made a slice at a time the same as made whole (the decoder's refusal over its caller's budget:
`test_prompt_budget.py`). The decoder is the tests' fake (`fake_decoder.py`), which scores its
prompt a character a position."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.prompt_logprobs import prompt_entries, prompt_json, prompt_logprobs

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _read(body: dict[str, Any]) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest()
    prompt_logprobs(body, request)
    return request


def test_the_field_asks_the_decoder_for_n_in_0_to_20_and_is_off_when_absent() -> None:
    assert not _read({}).output.HasField("prompt_logprobs")
    assert _read({"prompt_logprobs": 0}).output.prompt_logprobs == 0  # set: the prompt tokens' own
    assert _read({"prompt_logprobs": 20}).output.prompt_logprobs == 20


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "2"])
def test_a_value_outside_the_bound_or_not_an_integer_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(InvalidArgument) as caught:
        _read({"prompt_logprobs": value})
    assert caught.value.field == "prompt_logprobs"
    if isinstance(value, int) and not isinstance(value, bool):
        assert "[0, 20]" in str(caught.value)


@pytest.mark.parametrize("value", [0, 2])
def test_a_stream_is_refused_as_vllm_refuses_it_never_answered_without_them(value: int) -> None:
    with pytest.raises(InvalidArgument, match="stream") as caught:
        _read({"prompt_logprobs": value, "stream": True})
    assert caught.value.field == "prompt_logprobs"


def _scored(*positions: decoder_pb2.PromptLogprob) -> bytes:
    return decoder_pb2.TokenDelta(prompt_logprobs=positions).SerializeToString()


def test_entries_are_vllms_the_prompt_token_first_then_the_likeliest_ranked() -> None:
    top = decoder_pb2.TopLogprobs(token_ids=[7, 5], logprobs=[-0.25, -1.5], token_bytes=[b" a", b"\xe6\x88"])
    scored = _scored(
        decoder_pb2.PromptLogprob(token_id=3, token_bytes=b"<s>"),  # position 0: nothing before it
        decoder_pb2.PromptLogprob(
            token_id=5, logprob=-1.5, rank=2, token_bytes=b"\xe6\x88", top_logprobs=top
        ),
        decoder_pb2.PromptLogprob(
            token_id=9, logprob=float("-inf"), rank=49_152, token_bytes=b"b", top_logprobs=top
        ),
        decoder_pb2.PromptLogprob(top_logprobs=top),  # an embedding row: no token of its own
    )
    first, among, below, row = prompt_entries(scored)
    assert first is None
    # The prompt's token among the likeliest is one key, ranked where it is; part of a character U+FFFD.
    assert among == {
        "5": {"logprob": -1.5, "rank": 2, "decoded_token": "\ufffd"},
        "7": {"logprob": -0.25, "rank": 1, "decoded_token": " a"},
    }
    assert list(among) == ["5", "7"]  # the prompt's token first
    # Below them, its rank over the whole vocabulary (the decoder's); -inf is vLLM's -9999.0.
    assert below is not None and below["9"] == {"logprob": -9999.0, "rank": 49_152, "decoded_token": "b"}
    assert list(below) == ["9", "7", "5"]
    assert row is not None and list(row) == ["7", "5"]


def test_a_prompt_token_tied_with_a_listed_one_is_ranked_by_its_place_in_the_list_as_vllm_does() -> None:
    # No token is strictly likelier (the decoder's rank 1), but it is listed second: vLLM's dict keeps the
    # later write of a repeated key, the list's.
    top = decoder_pb2.TopLogprobs(token_ids=[7, 5], logprobs=[-0.5, -0.5])
    scored = _scored(
        decoder_pb2.PromptLogprob(token_id=3),
        decoder_pb2.PromptLogprob(token_id=5, logprob=-0.5, rank=1, top_logprobs=top),
    )
    assert prompt_entries(scored)[1] == {
        "5": {"logprob": -0.5, "rank": 2, "decoded_token": None},
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": None},
    }


def test_an_older_decoders_entries_have_no_decoded_token_and_a_rank_only_among_the_top_n() -> None:
    top = decoder_pb2.TopLogprobs(token_ids=[7], logprobs=[-0.25])
    scored = _scored(
        decoder_pb2.PromptLogprob(token_id=3),
        decoder_pb2.PromptLogprob(token_id=4, logprob=-2.0, top_logprobs=top),
        decoder_pb2.PromptLogprob(token_id=7, logprob=-0.25, top_logprobs=top),
    )
    assert prompt_entries(scored)[1:] == [
        {
            "4": {"logprob": -2.0, "rank": None, "decoded_token": None},
            "7": {"logprob": -0.25, "rank": 1, "decoded_token": None},
        },
        {"7": {"logprob": -0.25, "rank": 1, "decoded_token": None}},
    ]


@pytest.mark.parametrize("num_positions", [1, 47, 48, 49, 200])
async def test_the_json_in_slices_is_the_entries_dumped_whole(num_positions: int) -> None:
    top = decoder_pb2.TopLogprobs(token_ids=[1, 2], logprobs=[-0.5, -1.0], token_bytes=[b'"', b"\x01"])
    scored = _scored(
        *(decoder_pb2.PromptLogprob(token_id=p, logprob=-p, top_logprobs=top) for p in range(num_positions))
    )
    told: list[int] = []
    pieces = await prompt_json(scored, told.append)
    whole = json.dumps(prompt_entries(scored)).encode()
    assert b"".join(pieces) == whole
    assert sum(told) == len(whole)


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_each_completions_choice_has_its_prompts_scores_asked_once_per_prompt() -> None:
    body = {"prompt": ["ab", "xyz"], "n": 2, "prompt_logprobs": 1, "seed": 0}
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, answer = await _post(f"{url}/completions", body)
    assert status == 200, answer
    asked = [r.output.HasField("prompt_logprobs") for r in decoder.requests]
    assert sorted(asked) == [False, False, True, True]  # choice 0 of each prompt
    scores = [c["prompt_logprobs"] for c in answer["choices"]]
    b = {"98": {"logprob": -1.0, "rank": None, "decoded_token": "b"}}  # "ab"'s position 1, then its top 1
    assert scores[0] == scores[1] == [None, b | {"0": {"logprob": -0.5, "rank": 1, "decoded_token": "t0"}}]
    assert scores[2] == scores[3] and len(scores[2]) == 3 and list(scores[2][2]) == ["122", "0"]


async def test_a_chat_answer_has_its_prompts_scores_as_its_own_key_as_vllm_places_them() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, answer = await _post(f"{url}/chat/completions", CHAT | {"n": 2, "prompt_logprobs": 0})
        _, without = await _post(f"{url}/chat/completions", CHAT)
    assert status == 200, answer
    assert [r.output.HasField("prompt_logprobs") for r in decoder.requests[:2]].count(True) == 1
    assert answer["prompt_logprobs"] == [None, {"105": {"logprob": -1.0, "rank": None, "decoded_token": "i"}}]
    assert all("prompt_logprobs" not in choice for choice in answer["choices"])
    assert "prompt_logprobs" not in without


async def test_a_stream_asking_for_them_is_a_400_naming_the_field() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        for path, body in (("completions", {"prompt": "hi"}), ("chat/completions", CHAT)):
            status, answer = await _post(f"{url}/{path}", body | {"stream": True, "prompt_logprobs": 1})
            assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer
    assert not decoder.requests
