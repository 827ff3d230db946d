"""A step's grammar budget: the dearest requests fail, dearest first, until the rest fit."""

from __future__ import annotations

import math

import pytest

from tandem.client.errors import ErrorInfo, InvalidArgument, ResourceExhausted
from tandem.decoder.engine.step.grammar_budget import (
    heavy_mask_seconds,
    num_draft_tokens_within,
    over_budget,
    over_budget_error,
    row_seconds_ahead,
)


def test_a_step_within_its_budget_fails_nobody() -> None:
    assert over_budget({"a": 0.1, "b": 0.1}, max_seconds=0.25, heavy={"a", "b"}) == []
    assert over_budget({}, max_seconds=0.25, heavy=()) == []


def test_the_dearest_requests_fail_first_until_the_rest_fit() -> None:
    # 16 ambiguous grammars of 44 ms each cost 700 ms a step: the budget keeps what fits.
    seconds = {f"r{i}": 0.044 for i in range(16)} | {"dear": 0.2, "cheap": 0.001}
    failed = over_budget(seconds, max_seconds=0.25, heavy=seconds)
    assert failed[0] == "dear" and "cheap" not in failed
    assert sum(v for k, v in seconds.items() if k not in failed) <= 0.25
    assert sum(v for k, v in seconds.items() if k not in failed[:-1]) > 0.25  # no more than needed


def test_only_heavy_requests_fail_however_many_light_ones_pass_the_budget() -> None:
    # 64 cold bounded regexes cost 3-4 ms a mask each with Qwen3's vocabulary: 250 ms a step together.
    light = {f"r{i}": 0.004 for i in range(64)}
    assert over_budget(light, max_seconds=0.25, heavy=()) == []
    # Beside them, the heavy fail, dearest first, even where they are not enough to fit the budget.
    seconds = light | {"dear": 0.05, "dearer": 0.06}
    assert over_budget(seconds, max_seconds=0.25, heavy={"dear", "dearer"}) == ["dearer", "dear"]


def test_the_heavy_floor_is_20_ms_or_half_the_per_token_limit_where_that_is_less() -> None:
    # A floor at or over the per-token limit: every request that heavy had failed for its own limit,
    # and the step's cap never fired.
    assert heavy_mask_seconds(0.050) == 0.020  # the served 50 ms
    assert heavy_mask_seconds(0.020) == 0.010
    assert heavy_mask_seconds(0.004) == 0.002


def test_a_proposal_is_cut_to_the_rows_whose_masks_fit_the_requests_share() -> None:
    # An ambiguous grammar at 30 ms a mask: 16 proposed tokens were 17 masks, 510 ms in one step.
    assert num_draft_tokens_within(16, mask_seconds=0.030, max_seconds=0.25) == 7  # 8 masks, 240 ms
    assert num_draft_tokens_within(16, mask_seconds=0.100, max_seconds=0.25) == 1
    # Its own row is never cut: a request dearer than its share alone is the budget's to fail.
    assert num_draft_tokens_within(16, mask_seconds=0.300, max_seconds=0.25) == 0


def test_a_proposal_whose_masks_fit_is_verified_whole() -> None:
    assert num_draft_tokens_within(16, mask_seconds=0.001, max_seconds=0.25) == 16
    assert num_draft_tokens_within(4, mask_seconds=0.050, max_seconds=0.25) == 4  # 5 masks, 250 ms
    assert num_draft_tokens_within(16, mask_seconds=0.0, max_seconds=0.25) == 16  # no mask yet
    assert num_draft_tokens_within(16, mask_seconds=0.3, max_seconds=math.inf) == 16  # no budget


def test_a_rows_cost_ahead_is_the_last_steps_grown_as_it_grew_since_the_step_before() -> None:
    # `s: s s | /[a-z ]/`: 3 ms a row, then 9 ms; its masks' average (13 ms) predicted the next step's
    # 16 rows within 250 ms, and they cost 35 ms each.
    assert row_seconds_ahead(0.009, 0.003) == pytest.approx(0.027)
    assert row_seconds_ahead(0.009, 0.012) == 0.009  # a cost that fell is not taken to fall on
    assert row_seconds_ahead(0.009, 0.0) == 0.009  # one step known: no trend yet


def test_its_error_names_the_field_and_the_limit() -> None:
    error = over_budget_error("structured.grammar", 0.044, 0.7, 0.25, is_alone=False)
    assert isinstance(error, ResourceExhausted)
    assert str(error).startswith("structured.grammar: the grammar's work took 44.0 ms of CPU in one step")
    assert "700.0 ms in all, over the limit of 250 ms per step (--max-grammar-cpu-ms-per-step)" in str(error)
    assert error.info == ErrorInfo(
        "GRAMMAR_CPU",
        "tandem.decoder",
        {"grammarMicroseconds": "44000", "stepMicroseconds": "700000", "maxMicrosecondsPerStep": "250000"},
    )


def test_one_row_alone_over_the_budget_is_invalid_not_a_retry_that_fails_for_ever() -> None:
    # No step fits one token's mask dearer than the whole budget: RESOURCE_EXHAUSTED's Retry-After
    # invited a retry that fails the same way at the same point of its answer.
    error = over_budget_error("structured.grammar", 0.3, 0.3, 0.25, is_alone=True)
    assert isinstance(error, InvalidArgument) and error.field == "structured.grammar"
    assert str(error) == (
        "structured.grammar: the grammar's work for one token took 300.0 ms of CPU in one step, over the "
        "limit of 250 ms per step (--max-grammar-cpu-ms-per-step) by itself: no step fits it (an "
        "ambiguous grammar's parsing grows with its answer)"
    )


def test_one_row_over_the_budget_among_others_may_be_retried_among_fewer() -> None:
    error = over_budget_error("structured.grammar", 0.3, 0.7, 0.25, is_alone=False)
    assert isinstance(error, ResourceExhausted)


def test_a_speculating_request_is_weighed_by_its_cost_a_row_as_its_proposal_can_be_cut() -> None:
    # 3 rows of 100 ms: 300 ms in the step, but one row fits the budget (num_draft_tokens_within cuts
    # the next proposal to what fits): a wait may let it in.
    error = over_budget_error("structured.grammar", 0.3, 0.3, 0.25, num_rows=3, is_alone=True)
    assert isinstance(error, ResourceExhausted)
    error = over_budget_error("structured.grammar", 0.9, 0.9, 0.25, num_rows=3, is_alone=True)
    assert isinstance(error, InvalidArgument)


def test_a_matchers_rebuild_is_left_out_of_its_rows_cost() -> None:
    # A matcher grows to its limit of all once (grammar_growth.py): no retry rebuilds where it did.
    error = over_budget_error("structured.grammar", 3.1, 3.1, 0.25, is_alone=True, rebuild_seconds=3.0)
    assert isinstance(error, ResourceExhausted)


def test_one_row_alone_within_the_steps_noise_of_the_budget_is_no_verdict() -> None:
    # The same work at the cap measured 246.8 ms in one run and 250.2-258.8 in others: one noisy step
    # over it says no more than that a retry may fit.
    error = over_budget_error("structured.grammar", 0.27, 0.27, 0.25, is_alone=True)
    assert isinstance(error, ResourceExhausted)
    error = over_budget_error("structured.grammar", 0.28, 0.28, 0.25, is_alone=True)
    assert isinstance(error, InvalidArgument)
