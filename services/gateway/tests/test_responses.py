"""Generate events as OpenAI objects: the serialized fast path is the slow path's JSON, byte for byte."""

from __future__ import annotations

import json

import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.responses import Completion, answer


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


def test_service_field_paths_read_as_the_body_spells_them() -> None:
    from tandem.gateway.errors import body_field

    assert body_field("sampling.logit_bias[5]") == "logit_bias[5]"
    assert body_field("stopping.stop_sequences[0]: too long") == "stop[0]: too long"
    assert (
        body_field("chat.messages[1].content[0].embeddings.shape")
        == "messages[1].content[0].embeddings.shape"
    )
