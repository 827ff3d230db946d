"""The gateway reads what a refused stream needs and the limit from the decoder's prompt-logprob budget
refusal (its message carries them; no status detail does): the decoder's own wording must be what the
gateway reads, or a request that could never fit is told to retry again (a 429, not the 400)."""

from __future__ import annotations

import pytest

from tandem.client.errors import ResourceExhausted
from tandem.decoder.engine.admission.prompt_logprob_budget import PromptLogprobBudget
from tandem.gateway.prompt_budget import REFUSAL


def test_the_decoders_budget_refusal_is_worded_as_the_gateway_reads_it() -> None:
    budget = PromptLogprobBudget(max_model_len=16, max_entries=100)
    budget.reserve("caller", 60)
    with pytest.raises(ResourceExhausted) as caught:
        budget.reserve("caller", 48)
    match = REFUSAL.match(str(caught.value))
    assert match is not None, str(caught.value)
    assert (int(match[1]), int(match[2])) == (48, 100)
