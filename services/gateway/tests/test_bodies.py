"""Bodies converted in a worker process give what the same conversion gives in process; a worker that
dies is replaced and its body answered 503 (Unavailable); large bodies at once are bounded, and
those of one caller."""

from __future__ import annotations

import base64
import json
import sys

import pytest

from tandem.client.errors import InvalidArgument, Unavailable
from tandem.gateway.bodies import BodyWorkers, LargeBodies, convert, parse
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.calls import GenerateCall
from tandem.gateway.chat_request import chat_request
from tandem.gateway.errors import Refused

LIMITS = BodyLimits.for_chat(256, 16)
ROWS = {"dtype": "float32", "shape": [2, 4], "data": base64.b64encode(bytes(range(32))).decode()}
EMBEDDINGS = {"type": "tandem_embeddings", "embeddings": ROWS}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}}
BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE, EMBEDDINGS]},
    ],
    "logit_bias": {"5": -1.5},
    "stop": ["x"],
    "guided_regex": "a+",
    "stream": True,
}  # fmt: skip


async def test_a_worker_converts_a_body_exactly_as_the_gateway_would_and_refuses_it_alike() -> None:
    workers = BodyWorkers(1)
    try:
        raw = bytearray(json.dumps(BODY).encode())
        assert await workers.convert(chat_request, raw, LIMITS) == convert(chat_request, raw, LIMITS)
        wide = bytearray(json.dumps(BODY | {"stop": ["x"] * 17}).encode())
        with pytest.raises(InvalidArgument) as error:
            await workers.convert(chat_request, wide, LIMITS)
        assert error.value.field == "stop"
    finally:
        workers.close()


async def test_a_worker_that_dies_is_replaced_and_its_body_answered_unavailable() -> None:
    workers = BodyWorkers(1)
    try:
        await workers.start()
        (worker,) = workers._workers
        worker._process.kill()
        worker._process.join(5)
        with pytest.raises(Unavailable):
            await workers.convert(chat_request, bytearray(json.dumps(BODY).encode()), LIMITS)
        call = await workers.convert(chat_request, bytearray(json.dumps(BODY).encode()), LIMITS)
        assert call.names.structured == "guided_regex"
    finally:
        workers.close()


def _broken(body: dict, limits: BodyLimits) -> GenerateCall:
    """A conversion with a bug in it."""
    raise KeyError("a bug")


async def test_a_bug_in_a_worker_is_an_error_of_its_own_and_the_worker_serves_on() -> None:
    workers = BodyWorkers(1)
    try:
        with pytest.raises(RuntimeError, match="KeyError: 'a bug'"):  # a 500 with the worker's traceback
            await workers.convert(_broken, bytearray(b"{}"), LIMITS)
        call = await workers.convert(chat_request, bytearray(json.dumps(BODY).encode()), LIMITS)
        assert call.model == "m"
    finally:
        workers.close()


def test_large_bodies_beyond_the_bound_are_503_until_one_is_released() -> None:
    bodies = LargeBodies(2, 2)
    first, _ = bodies.take("peer:a"), bodies.take("peer:b")
    with pytest.raises(Refused) as refused:
        bodies.take("peer:c")
    assert refused.value.error.status == 503 and refused.value.error.retry_after_s == 1.0
    assert "--max-large-bodies" in refused.value.error.message
    first.release()
    first.release()  # idempotent: a place is given back once
    bodies.take("peer:c")
    assert bodies.num_held == 2


def test_a_caller_beyond_its_share_is_429_while_another_caller_still_takes_a_place() -> None:
    bodies = LargeBodies(4, 2)
    first, _ = bodies.take("peer:a"), bodies.take("peer:a")
    with pytest.raises(Refused) as refused:
        bodies.take("peer:a")
    error = refused.value.error
    assert (error.status, error.type, error.retry_after_s) == (429, "rate_limit_error", 1.0)
    assert "--max-large-bodies-per-caller" in error.message
    bodies.take("peer:b")  # the places a's share leaves are the others'
    first.release()
    first.release()  # a's place given back once
    bodies.take("peer:a")
    assert bodies.num_held == 3


def test_an_integer_too_long_to_read_is_refused_in_the_callers_terms() -> None:
    # Python's own words told the HTTP caller to call sys.set_int_max_str_digits().
    with pytest.raises(InvalidArgument) as error:
        parse(b'{"seed": ' + b"9" * 5000 + b"}")
    assert (error.value.field, error.value.description) == (
        "body",
        f"holds an integer of 5000 digits, over the {sys.get_int_max_str_digits()} a number may have",
    )


@pytest.mark.parametrize(
    "fields",
    ['"messages": [{"role": "user", "content": "\\ud800"}]', '"chat_template_kwargs": {"\\udfff": true}'],
)
def test_a_lone_surrogate_anywhere_is_the_bodys_not_valid_utf8(fields: str) -> None:
    # Python's parser lets it through; a chat_template_kwargs key was told it held no finite number.
    raw = ('{"messages": [{"role": "user", "content": "x"}], ' + fields + "}").encode()
    with pytest.raises(InvalidArgument) as error:
        convert(chat_request, raw, BodyLimits.for_chat(256, 16))
    assert (error.value.field, error.value.description) == (
        "body",
        "holds a lone UTF-16 surrogate, which is not valid UTF-8 text",
    )
