"""The gateway reads what a refused stream needs and the limit from the decoder's prompt-logprob budget
refusal: from its ErrorInfo, and from its message where a decoder from before the ErrorInfo sent only
that. Both must be what the decoder says, or a request that could never fit is told to retry again (a
429, not the 400): the ErrorInfo as the decoder's status carries it, and the wording (which clients
read, and older gateways parse) as the gateway's fallback reads it."""

from __future__ import annotations

import re

import grpc
import pytest
from grpc_status import rpc_status

from tandem.client.errors import ResourceExhausted
from tandem.client.status import to_status_proto
from tandem.decoder.engine.admission.prompt_logprob_budget import PromptLogprobBudget
from tandem.gateway import prompt_budget
from tandem.gateway.prompt_budget import REFUSAL


def _refusal() -> ResourceExhausted:
    budget = PromptLogprobBudget(max_model_len=16, max_entries=100)
    budget.reserve("caller", 60)
    with pytest.raises(ResourceExhausted) as caught:
        budget.reserve("caller", 48)
    return caught.value


def test_the_decoders_budget_refusal_is_worded_as_the_gateway_reads_it() -> None:
    refusal = _refusal()
    match = REFUSAL.match(str(refusal))
    assert match is not None, str(refusal)
    assert (int(match[1]), int(match[2])) == (48, 100)


def test_the_decoders_budget_refusal_carries_the_error_info_the_gateway_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = rpc_status.to_status(to_status_proto(_refusal()))
    trailers = grpc.aio.Metadata(*status.trailing_metadata)
    error = grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailers, status.details)
    monkeypatch.setattr(prompt_budget, "REFUSAL", re.compile("(?!)"))  # the words read as nothing
    assert prompt_budget.needs_and_limit(error) == (48, 100)
