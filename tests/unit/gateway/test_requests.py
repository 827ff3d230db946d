"""OpenAI bodies into gRPC requests: any JSON a caller can send is either converted or refused with
InvalidArgument naming the field, never another exception (which would be a 500)."""

from __future__ import annotations

import pytest

from tandem.client.errors import InvalidArgument
from tandem.gateway import requests

CHAT = {"model": "", "messages": [{"role": "user", "content": "hi"}]}
ROWS = {"dtype": "float32", "shape": [1, 4], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}
URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}


def _user(*parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def _rows(**changes: object) -> dict:
    return {"type": "tandem_embeddings", "embeddings": ROWS | changes}


HOSTILE_CHAT = {
    "top_k -2": ({"top_k": -2}, "top_k"),
    "top_k 2**40": ({"top_k": 2**40}, "top_k"),
    "top_k 1.5": ({"top_k": 1.5}, "top_k"),
    "top_k NaN": ({"top_k": float("nan")}, "top_k"),
    "max_tokens 2**32": ({"max_tokens": 2**32}, "max_tokens"),
    "max_tokens true": ({"max_tokens": True}, "max_tokens"),
    "max_completion_tokens 0": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "min_tokens -1": ({"min_tokens": -1}, "min_tokens"),
    "seed 2**64": ({"seed": 2**64}, "seed"),
    "seed -1": ({"seed": -1}, "seed"),
    "top_logprobs -1": ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "top_logprobs 21": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "logprobs a string": ({"logprobs": "yes"}, "logprobs"),
    "temperature 10**400": ({"temperature": 10**400}, "temperature"),
    "temperature Infinity": ({"temperature": float("inf")}, "temperature"),
    "top_p NaN": ({"top_p": float("nan")}, "top_p"),
    "min_p a list": ({"min_p": [1]}, "min_p"),
    "logit_bias key too big": ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
    "logit_bias key a superscript digit": ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    "logit_bias value true": ({"logit_bias": {"5": True}}, "logit_bias"),
    "logit_bias value NaN": ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    "n 3": ({"n": 3}, "n"),
    "n 0": ({"n": 0}, "n"),
    "stop a number": ({"stop": 5}, "stop"),
    "stop of 17": ({"stop": ["x"] * 17}, "stop"),
    "rows with a bool dimension": (_user(_rows(shape=[True, 4])), "messages[0].content[0].embeddings.shape"),
    "rows of 2**70": (_user(_rows(shape=[2**70, 4])), "messages[0].content[0].embeddings.shape"),
    "rows with an unhashable dtype": (_user(_rows(dtype=["x"])), "messages[0].content[0].embeddings.dtype"),
    "a remote image URL": (
        _user({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
        "messages[0].content[0].image_url",
    ),
    "17 images": (_user(*[URL] * 17), "messages"),
}  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE_CHAT)
def test_a_hostile_chat_body_is_invalid_argument_naming_the_field(name: str) -> None:
    extra, field = HOSTILE_CHAT[name]
    with pytest.raises(InvalidArgument) as error:
        body = CHAT | extra
        requests.image_urls(body)
        requests.chat_request(body, images_pending=True)
    assert error.value.field == field, str(error.value)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ([-1], "prompt"),
        ([2**32], "prompt"),
        (["a", [-1]], "prompt[1]"),
        (["a", [True]], "prompt[1]"),
        (5, "prompt"),
    ],
)
def test_hostile_completion_prompts_are_invalid_argument(prompt: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        requests.completion_request({"prompt": prompt})
    assert error.value.field == field


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": [-1]}, "input"),
        ({"input": [[2**32]]}, "input[0]"),
        ({"input": [True]}, "input[0]"),
        ({"input": "x", "tandem_pooling": "none"}, "encoding_format"),
        ({"input": ["x"] * 65}, "input"),
    ],
)
def test_hostile_embedding_inputs_are_invalid_argument(body: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        requests.embed_request(body)
    assert error.value.field == field


def test_vllms_top_k_minus_one_means_off() -> None:
    assert requests.chat_request(CHAT | {"top_k": -1}).sampling.top_k == 0
