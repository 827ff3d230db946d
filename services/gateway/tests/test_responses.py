"""Generate events as OpenAI objects: the serialized fast path is the slow path's JSON, byte for byte."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.responses import Completion, answer, answer_frame, share_scores


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("text", ["hello", "", 'quote " and \\ and \n', "caf\u00e9 \u2603", "\x00"])
def test_a_text_chunk_is_the_chunks_json(kind: str, text: str) -> None:
    completion = Completion(kind, "abc", "tiny")
    expected = json.dumps(completion.chunk(decoder_pb2.TokenDelta(text=text), False), separators=(",", ":"))
    assert completion.text_chunk(text) == expected
    assert json.loads(completion.text_chunk(text)) == json.loads(expected)


def test_finish_reasons_and_usage() -> None:
    completion = Completion("chat", "abc", "tiny")
    completion.add(decoder_pb2.TokenDelta(text="hi"), False)
    completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_STOP_SEQUENCE)
    completion.finished.usage.input_tokens, completion.finished.usage.output_tokens = 5, 1
    whole = answer([completion], False)
    message = {"role": "assistant", "content": "hi"}
    assert whole["choices"][0] == {"index": 0, "finish_reason": "stop", "message": message, "logprobs": None}
    assert whole["usage"]["total_tokens"] == 6 and whole["object"] == "chat.completion"


def test_streamed_completion_text_offsets_run_over_the_whole_completion() -> None:
    completion = Completion("text", "abc", "tiny")
    offsets = []
    for text in ("Once", " upon", " a"):
        delta = decoder_pb2.TokenDelta(text=text, token_ids=[1], logprobs=[-float("inf")])
        chunk = completion.chunk(delta, True)
        offsets += chunk["choices"][0]["logprobs"]["text_offset"]
        assert chunk["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]  # never -Infinity in JSON
    assert offsets == [0, 4, 9]


def test_a_token_whose_text_reads_token_id_takes_its_characters_in_text_offset() -> None:
    # A token is spelled `token_id:N` only when it has no text of its own (its `bytes` null); a token
    # whose decoded text is "token_id:7" is 10 characters of the completion like any other.
    deltas = [
        decoder_pb2.TokenDelta(text="token_id:7", token_ids=[5], logprobs=[-1.0]),
        decoder_pb2.TokenDelta(text="", token_ids=[6], logprobs=[-1.0]),  # no text: `token_id:6`, none
        # Two tokens in one delta: its text is the first's, the second is spelled by its ID after it.
        decoder_pb2.TokenDelta(text="token_id:8", token_ids=[7, 8], logprobs=[-1.0, -1.0]),
        decoder_pb2.TokenDelta(text=" end", token_ids=[9], logprobs=[-1.0]),
    ]
    streamed, whole = Completion("text", "abc", "tiny"), Completion("text", "abc", "tiny")
    offsets = []
    for delta in deltas:
        offsets += streamed.chunk(delta, True)["choices"][0]["logprobs"]["text_offset"]
        whole.add(delta, True)
    logprobs = whole.choice(True)["logprobs"]
    assert logprobs["tokens"] == ["token_id:7", "token_id:6", "token_id:8", "token_id:8", " end"]
    assert offsets == logprobs["text_offset"] == [0, 10, 10, 20, 20]


def test_service_field_paths_read_as_the_body_spells_them() -> None:
    from tandem.gateway.errors import body_field

    assert body_field("sampling.logit_bias[5]") == "logit_bias[5]"
    assert body_field("stopping.stop_sequences[0]: too long") == "stop[0]: too long"
    assert (
        body_field("chat.messages[1].content[0].embeddings.shape")
        == "messages[1].content[0].embeddings.shape"
    )


def _delta(token_id: int) -> decoder_pb2.TokenDelta:
    """A token with 20 alternatives, as `top_logprobs: 20` asks."""
    delta = decoder_pb2.TokenDelta(text=f" w{token_id}", token_ids=[token_id], logprobs=[-1.5])
    delta.top_logprobs.add(token_ids=list(range(1000, 1020)), logprobs=[-2.0 - k / 10 for k in range(20)])
    return delta


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_an_answer_serialized_a_choice_at_a_time_is_the_answers_json(kind: str) -> None:
    model = "\x00tandem-choices\x00"  # the frame's own marker, as a model's name: still one answer
    completions = [Completion(kind, "abc", model, index=i) for i in range(3)]
    for i, completion in enumerate(completions):
        for token_id in range(i + 2):
            completion.add(_delta(token_id), True)
        completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_LENGTH)
        completion.finished.usage.input_tokens, completion.finished.usage.output_tokens = 4, i + 2
    before, after = answer_frame(completions)
    pieces = [json.dumps(c.choice(True)) for c in completions]
    assert before + ", ".join(pieces) + after == json.dumps(answer(completions, True))
    assert json.loads(before + after)["choices"] == []


def test_a_choices_logprobs_are_kept_compact_until_the_answer_is_written() -> None:
    # As OpenAI's entries (a dict for the token and each alternative) 4,096 tokens took 25 MB; 16
    # choices of 8,192 tokens 816 MB in the gateway before the answer was even written.
    completion = Completion("chat", "abc", "tiny")
    tracemalloc.start()
    try:
        for token_id in range(4096):
            completion.add(_delta(token_id), True)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2 * 2**20, held
    assert len(completion.choice(True)["logprobs"]["content"]) == 4096


def _scored_delta(num_positions: int) -> decoder_pb2.TokenDelta:
    delta = _delta(0)
    top = decoder_pb2.TopLogprobs(token_ids=[3], logprobs=[-0.5], token_bytes=[b" x"])
    delta.prompt_logprobs.extend(
        decoder_pb2.PromptLogprob(token_id=p, logprob=-1.0, token_bytes=b"y", top_logprobs=top)
        for p in range(num_positions)
    )
    return delta


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_prompt_logprobs_are_each_completions_choices_and_a_chat_answers_own(kind: str) -> None:
    # Prompt 0's choice 0 asked (`choices.py`); its choice 1 and prompt 1's choice (which did not) share.
    completions = [Completion(kind, "abc", "m", index=i, prompt_index=i // 2) for i in range(3)]
    completions[0].add(scored := _scored_delta(3), True)
    await completions[0].bound_scores(scored)
    for completion in completions[1:]:
        completion.add(_delta(0), True)
    bound = completions[1].json_bound
    share_scores(completions)
    whole = answer(completions, True)
    if kind == "text":
        assert whole["choices"][0]["prompt_logprobs"] == whole["choices"][1]["prompt_logprobs"]
        assert len(whole["choices"][0]["prompt_logprobs"]) == 3 and completions[1].json_bound > bound
        assert "prompt_logprobs" not in whole["choices"][2] and "prompt_logprobs" not in whole
    else:  # vLLM's ChatCompletionResponse.prompt_logprobs, after its usage
        assert list(whole)[-1] == "prompt_logprobs" and len(whole["prompt_logprobs"]) == 3
        assert all("prompt_logprobs" not in c for c in whole["choices"])
    before, after = answer_frame(completions)
    pieces = [json.dumps(c.choice(True)) for c in completions]
    assert before + ", ".join(pieces) + after == json.dumps(whole)
    # Kept once: the delta's bytes, one object among the tokens' deltas (logprobs) and as the scores.
    assert completions[0].scored is completions[0].deltas[0]
    assert completions[1].scored is (completions[0].scored if kind == "text" else None)
