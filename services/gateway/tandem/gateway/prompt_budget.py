"""The decoder's refusal of prompt logprobs over its caller's budget: a 429 with Retry-After where other
streams hold the budget, a 400 where the request's own prompts alone are over it.

NOTE: why the gateway tells them apart. The decoder holds each stream's prompt-logprob entries (its
prompt positions x (1 + N)) against its caller's budget from admission until the stream ends, and
refuses a stream beyond the budget RESOURCE_EXHAUSTED with RetryInfo (its admission/
prompt_logprob_budget.py): right when the caller's other streams hold the rest, as they end. But the
choices of one request are all open at once (`choice_streams`), so where the entries of the request's
own choices that asked for them and the refused one's are more than the limit, the entries "already
held" are its own and the same request again meets the same refusal: 6 prompts of 2,800 IDs with
prompt_logprobs 20 against a decoder of 2,912 positions (a limit of 4 x 2,912 x 21 = 244,608 entries,
352,800 asked) got 429 and Retry-After. The decoder says what the refused stream needs and the limit
in its ErrorInfo (PROMPT_LOGPROB_BUDGET, tandem.client.error_reasons); a decoder from before it said
them in its message alone, read as it words them (REFUSAL), and a refusal that says them neither way
stays the 429. What the request's other choices hold is counted from what the gateway
knows of them when the refusal comes, never more than they hold: a choice the decoder accepted holds
its accepted prompt tokens, one not accepted yet at least its prompt's token IDs (0 for text, whose
tokens the gateway does not know), so a request counted over the limit is over it.
"""

from __future__ import annotations

import dataclasses
import re

import grpc

from tandem.client import error_reasons as reasons
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.client.status_details import status_details
from tandem.gateway.errors import HttpError

# ASCII digits, at most 18 (an int64's worth): str.isdigit() and \d take '²' and other Unicode digits,
# which int() refuses, and int() refuses a string over 4,300 digits: either was a gateway 500.
COUNT = "[0-9]{1,18}"
# The decoder's refusal as its message words it (admission/prompt_logprob_budget.py): what the refused
# stream needs and the caller's limit. Read only where the status carries no ErrorInfo (an older decoder).
REFUSAL = re.compile(
    rf"^output\.prompt_logprobs: .*this request needs ({COUNT}) more .*the limit is ({COUNT})(?![0-9])"
)


def entries_held(request: decoder_pb2.GenerateRequest, accepted_tokens: int | None) -> int:
    """The fewest prompt-logprob entries a choice's Generate `request` holds in the decoder once it was
    admitted: none unless it asked; `accepted_tokens` its PromptAccepted's count (None before)."""
    if not request.output.HasField("prompt_logprobs"):
        return 0
    if accepted_tokens is None:  # at least its token IDs (the decoder counts what it adds too)
        accepted_tokens = sum(len(segment.token_ids.ids) for segment in request.prompt)
    return accepted_tokens * (1 + request.output.prompt_logprobs)


def refusal_of_request(error: grpc.aio.AioRpcError, http: HttpError, held_by_request: int) -> HttpError:
    """`http` (`error` in OpenAI's shape), or a 400 naming prompt_logprobs, with no Retry-After, where
    `error` is the budget's refusal and the entries the request's other choices hold
    (`held_by_request`, counted by `entries_held`) and the refused one's are over the limit."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return http
    refused = needs_and_limit(error)
    if refused is None:
        return http
    needs, limit = refused
    if held_by_request + needs <= limit:
        return http  # others hold the rest: they end, and a retry fits
    message = (
        f"prompt_logprobs: this request's prompts need at least {held_by_request + needs} prompt-logprob "
        f"entries at once (positions x (1 + prompt_logprobs), each prompt's choices counted once) and the "
        f"decoder's limit per caller is {limit}; send fewer or shorter prompts, or a smaller "
        f"prompt_logprobs"
    )
    return dataclasses.replace(
        http,
        status=400,
        type="invalid_request_error",
        message=message,
        param="prompt_logprobs",
        retry_after_s=None,
    )


def needs_and_limit(error: grpc.aio.AioRpcError) -> tuple[int, int] | None:
    """The entries the budget's refusal `error` says the refused stream needs and the caller's limit:
    from its ErrorInfo, else from its message (a decoder without one); None for any other refusal."""
    metadata = status_details(error).metadata_of(reasons.DECODER, reasons.PROMPT_LOGPROB_BUDGET)
    if metadata is not None:
        needs, limit = metadata.get(reasons.NEEDED_ENTRIES, ""), metadata.get(reasons.MAX_ENTRIES, "")
        if re.fullmatch(COUNT, needs) and re.fullmatch(COUNT, limit):
            return int(needs), int(limit)
    match = REFUSAL.match(error.details() or "")
    return (int(match[1]), int(match[2])) if match is not None else None
