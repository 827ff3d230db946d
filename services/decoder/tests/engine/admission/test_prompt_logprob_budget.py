"""PromptLogprobBudget: each caller's open streams hold at most its entries; ends give them back."""

from __future__ import annotations

import pytest

from tandem.client.errors import ErrorInfo, ResourceExhausted
from tandem.decoder.engine.admission.prompt_logprob_budget import (
    FULL_PROMPTS_PER_CALLER,
    PromptLogprobBudget,
    num_entries,
)


def test_a_caller_may_hold_four_full_context_prompts_at_the_most_alternatives() -> None:
    budget = PromptLogprobBudget(max_model_len=1000)
    assert budget.max_entries == FULL_PROMPTS_PER_CALLER * 1000 * 21 == 84_000
    releases = [budget.reserve("a", num_entries(1000, 20)) for _ in range(FULL_PROMPTS_PER_CALLER)]
    with pytest.raises(ResourceExhausted, match=r"output\.prompt_logprobs.*needs 1 more.*limit is 84000"):
        budget.reserve("a", 1)
    budget.reserve("b", num_entries(1000, 20))  # callers do not share a budget
    releases[0]()
    assert budget.held("a") == 3 * 21_000
    budget.reserve("a", 21_000)


def test_a_refusal_gives_what_is_held_what_is_needed_and_the_limit_in_its_error_info() -> None:
    budget = PromptLogprobBudget(max_model_len=10, max_entries=100)
    budget.reserve("a", 60)
    with pytest.raises(ResourceExhausted) as caught:
        budget.reserve("a", 48)
    assert caught.value.info == ErrorInfo(
        "PROMPT_LOGPROB_BUDGET",
        "tandem.decoder",
        {"heldEntries": "60", "neededEntries": "48", "maxEntries": "100"},
    )
    assert caught.value.retry_after_s > 0  # others' streams end: a wait lets it in


def test_a_refused_reservation_holds_nothing() -> None:
    budget = PromptLogprobBudget(max_model_len=10, max_entries=100)
    with pytest.raises(ResourceExhausted):
        budget.reserve("a", 101)
    assert budget.held("a") == 0
