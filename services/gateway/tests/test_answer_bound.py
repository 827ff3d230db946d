"""The most bytes a non-streamed answer takes, reckoned from its request: never under the JSON the
gateway writes for tokens whose text averages up to 8 UTF-8 bytes (escaped, multi-byte, control
characters; 10-digit token IDs; float32's longest logprobs), chat's and completions' shapes, with and
without logprobs; its tokens max_tokens, else what the context leaves after the prompt's token IDs."""

from __future__ import annotations

import json

import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.answer_bound import answer_bound, choice_bound
from tandem.gateway.calls import GenerateCall
from tandem.gateway.errors import BodyNames
from tandem.gateway.responses import Completion, answer

LONGEST_LOGPROB = -1.0649640863824063e-32  # float32's, 23 characters as JSON
TEXTS = ("\x01\x02\x03\x04\x05\x06\x07\x08", 'é\n"\\ab', "🙂🙂", "日本", "        ", "")  # 8 bytes at most


def _call(num_tokens: int | None, top: int | None, n: int = 1, prompt_ids: int = 0) -> GenerateCall:
    generate = decoder_pb2.GenerateRequest()
    if prompt_ids:
        generate.prompt.add().token_ids.ids.extend(range(prompt_ids))
    else:
        generate.prompt.add().text = "p"
    if num_tokens is not None:
        generate.stopping.max_new_tokens = num_tokens
    if top is not None:
        generate.output.logprobs, generate.output.top_logprobs = True, top
    return GenerateCall((generate,), n, False, (), "", False, False, BodyNames())


def _completion(kind: str, index: int, num_tokens: int, top: int | None) -> Completion:
    completion = Completion(kind, "f" * 32, "model", index, 0, 2**31)
    for k in range(num_tokens):
        delta = decoder_pb2.TokenDelta(text=TEXTS[k % len(TEXTS)], token_ids=[2**32 - 1 - k])
        if top is not None:
            delta.logprobs.append(LONGEST_LOGPROB)
            alternatives = delta.top_logprobs.add()
            alternatives.token_ids.extend(2**32 - 1 - j for j in range(top))
            alternatives.logprobs.extend([LONGEST_LOGPROB] * top)
        completion.add(delta, top is not None)
    completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_CONTEXT_LIMIT)
    completion.finished.usage.input_tokens = completion.finished.usage.output_tokens = 2**31
    return completion


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("top", [None, 0, 20])
def test_the_bound_is_over_the_answer_of_tokens_of_up_to_8_bytes(kind: str, top: int | None) -> None:
    num_tokens, n = 60, 3
    completions = [_completion(kind, index, num_tokens, top) for index in range(n)]
    written = len(json.dumps(answer(completions, top is not None)).encode())
    bound = answer_bound(_call(num_tokens, top, n), "model", 4096)
    assert written <= bound < 4 * written + 2000  # a bound, not a wild one


def test_a_requests_tokens_are_its_max_tokens_else_what_the_context_leaves() -> None:
    per_token = choice_bound(_call(2, None).requests[0], 4096) - choice_bound(
        _call(1, None).requests[0], 4096
    )
    assert choice_bound(_call(10, None).requests[0], 4096) == choice_bound(
        _call(0, None).requests[0], 4096
    ) + (10 * per_token)
    unset = choice_bound(_call(None, None).requests[0], 4096)
    assert unset == choice_bound(_call(4095, None).requests[0], 4096)  # a text prompt: one position at least
    ids = choice_bound(_call(None, None, prompt_ids=96).requests[0], 4096)
    assert ids == choice_bound(_call(4000, None).requests[0], 4096)  # its 96 token IDs counted
    assert choice_bound(_call(9000, None).requests[0], 4096) == unset  # never past the context
    assert answer_bound(_call(5, 20, n=4), "m", 4096) > 4 * choice_bound(_call(5, 20).requests[0], 4096)
