"""The decoder's refusal of prompt logprobs over its caller's budget: a 429 with Retry-After where other
streams hold the rest, a 400 naming prompt_logprobs, with no Retry-After, where the request's own prompts
alone are over the limit (no retry of it can fit). The gateway reads the numbers from the refusal's
ErrorInfo, and from its message where a decoder from before the ErrorInfo sent none. The decoder is the
tests' fake (`fake_decoder.py`): a prompt holding `budget:L` is refused where the entries of its open
streams and its own are over L (`wordsonly`: with no ErrorInfo)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_status import rpc_status

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, ResourceExhausted
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.client.status import to_status_proto
from tandem.gateway import prompt_budget
from tandem.gateway.errors import HttpError, from_grpc
from tandem.gateway.prompt_budget import entries_held, refusal_of_request

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway

REFUSAL = (
    "output.prompt_logprobs: this caller's open streams already hold {held} prompt-logprob entries; this "
    "request needs {needs} more (positions x (1 + top)) and the limit is {limit}; read or end a stream that "
    "scores its prompt"
)
BUSY = HttpError(429, "rate_limit_error", "prompt_logprobs: ...", retry_after_s=1.0)


def _error(details: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> grpc.aio.AioRpcError:
    """A refusal as a decoder from before the ErrorInfo sent it: its code and message alone."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _budget(held: int, needs: int, limit: int) -> ErrorInfo:
    numbers = {reasons.HELD_ENTRIES: held, reasons.NEEDED_ENTRIES: needs, reasons.MAX_ENTRIES: limit}
    return reasons.decoder_info(reasons.PROMPT_LOGPROB_BUDGET, numbers)


def _refused(message: str, info: ErrorInfo, retry_after_s: float = 1.0) -> grpc.aio.AioRpcError:
    """A refusal as the decoder sends it: its details in the `grpc-status-details-bin` trailer."""
    status = rpc_status.to_status(to_status_proto(ResourceExhausted(message, retry_after_s, info=info)))
    trailers = grpc.aio.Metadata(*status.trailing_metadata)
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailers, status.details)


def _is_the_400(refused: HttpError) -> bool:
    return (refused.status, refused.type, refused.param, refused.headers()) == (
        400,
        "invalid_request_error",
        "prompt_logprobs",
        {},
    )


def test_an_error_info_the_requests_own_prompts_are_over_is_a_400_whatever_the_message_says() -> None:
    error = _refused("output.prompt_logprobs: over the budget, in other words", _budget(60, 48, 80))
    refused = refusal_of_request(error, from_grpc(error), held_by_request=60)
    assert _is_the_400(refused), refused
    assert "108 " in refused.message and "limit per caller is 80" in refused.message


def test_an_error_info_others_hold_the_rest_of_is_a_429_after_its_retry_info() -> None:
    error = _refused(REFUSAL.format(held=60, needs=48, limit=80), _budget(60, 48, 80), retry_after_s=3.0)
    refused = refusal_of_request(error, from_grpc(error), held_by_request=0)
    assert (refused.status, refused.headers()) == (429, {"Retry-After": "3"})


@pytest.mark.parametrize(
    "info",
    [
        reasons.decoder_info(reasons.QUEUE_FULL, {reasons.MAX_WAITING_REQUESTS: 2}),  # another refusal
        ErrorInfo("PROMPT_LOGPROB_BUDGET", "another.service", {"neededEntries": "48", "maxEntries": "8"}),
        reasons.decoder_info(reasons.PROMPT_LOGPROB_BUDGET, {reasons.MAX_ENTRIES: 8}),  # no need said
    ],
)
def test_an_error_info_of_another_refusal_or_without_the_numbers_stays_a_429(info: ErrorInfo) -> None:
    assert refusal_of_request(_refused("queue full", info), BUSY, held_by_request=100) is BUSY


def test_an_older_decoders_refusal_the_requests_own_prompts_are_over_is_a_400_from_its_words() -> None:
    error = _error(REFUSAL.format(held=60, needs=48, limit=80))
    refused = refusal_of_request(error, BUSY, held_by_request=60)
    assert _is_the_400(refused), refused
    assert refused.message.startswith("prompt_logprobs: ") and "108 " in refused.message
    assert "limit per caller is 80" in refused.message


@pytest.mark.parametrize(
    "error",
    [
        _error(REFUSAL.format(held=60, needs=48, limit=80)),  # 60 held by others: they end
        _error("output.prompt_logprobs: over the budget, in other words"),
        _error("too many streams on this connection"),
        _error(REFUSAL.format(held=60, needs=48, limit=80), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_any_other_refusal_stays_as_it_was(error: grpc.aio.AioRpcError) -> None:
    assert refusal_of_request(error, BUSY, held_by_request=0) is BUSY


def test_a_choice_holds_its_accepted_tokens_else_at_least_its_token_ids() -> None:
    request = decoder_pb2.GenerateRequest()
    request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=[1, 2, 3]))
    request.prompt.add(text="some text")  # tokens the gateway does not know
    request.prompt.add(token_ids=tensor_pb2.TokenIds(ids=[4, 5]))
    assert entries_held(request, 40) == 0  # it did not ask
    request.output.prompt_logprobs = 2
    assert (entries_held(request, 40), entries_held(request, None)) == (120, 15)


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
    async with aiohttp.ClientSession() as session, session.post(f"{url}/completions", json=body) as response:
        return response.status, await response.json(), response.headers.get("Retry-After")


@pytest.mark.parametrize(
    "prompt",
    [
        "budget",  # 6 positions x 3 entries, the limit 1: over alone
        "budget wordsonly",  # the same from a decoder that says so in words alone
        # Two of 11 positions accepted (66 entries), then the third's 51 refused: 117 over 100.
        ["hang-aaaaaa", "hang-bbbbbb", "after2 budget:100"],
    ],
)
async def test_a_request_over_the_limit_on_its_own_is_a_400_with_no_retry(prompt: str | list[str]) -> None:
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        status, answer, retry_after = await _post(url, {"prompt": prompt, "prompt_logprobs": 2})
    assert (status, retry_after, answer["error"]["param"]) == (400, None, "prompt_logprobs"), answer
    assert answer["error"]["message"].startswith("prompt_logprobs: this request's prompts need")


async def test_a_request_another_stream_holds_the_budget_from_is_a_429_to_retry() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        # Its 4 positions hold 12 entries; then 9 positions need 27: 39 over 30, but 27 alone fit.
        holder = asyncio.ensure_future(_post(url, {"prompt": "hang", "prompt_logprobs": 2}))
        try:
            async with asyncio.timeout(5):
                while decoder.num_open < 1:
                    await asyncio.sleep(0.005)
            status, answer, retry_after = await _post(url, {"prompt": "budget:30", "prompt_logprobs": 2})
        finally:
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder
    assert (status, retry_after) == (429, "1"), answer
    assert answer["error"]["type"] == "rate_limit_error"
    assert answer["error"]["message"].startswith("prompt_logprobs: ")


@pytest.mark.parametrize("needs", ["\u00b2", "\u0664\u0668", "9" * 5000, "-48", " 48"])
def test_numbers_that_are_not_plain_ascii_decimals_are_not_read_and_the_refusal_stays_a_429(
    needs: str,
) -> None:
    # str.isdigit() took '²', which int() refuses, and int() refuses a 5,000-digit string: a gateway 500
    # instead of the decoder's refusal. Only ASCII decimals, as the decoder writes them, are read.
    numbers = {reasons.HELD_ENTRIES: "0", reasons.NEEDED_ENTRIES: needs, reasons.MAX_ENTRIES: "8"}
    info = ErrorInfo(reasons.PROMPT_LOGPROB_BUDGET, reasons.DECODER, numbers)
    message = REFUSAL.format(held=0, needs=needs, limit=8)
    assert refusal_of_request(_refused(message, info), BUSY, held_by_request=100) is BUSY


def test_a_limit_of_more_digits_than_are_read_is_not_read_as_its_first_ones() -> None:
    # The pattern's limit had no end: 19 digits were read as their first 18.
    assert prompt_budget.REFUSAL.match(REFUSAL.format(held=0, needs=48, limit="1" + "0" * 18)) is None
    assert prompt_budget.REFUSAL.match(REFUSAL.format(held=0, needs=48, limit="1" + "0" * 17)) is not None
