"""A step's grammar budget: the dearest requests fail, dearest first, until the rest fit."""

from __future__ import annotations

from tandem.client.errors import ResourceExhausted
from tandem.decoder.engine.step.grammar_budget import heavy_mask_seconds, over_budget, over_budget_error


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


def test_its_error_names_the_field_and_the_limit() -> None:
    error = over_budget_error("structured.grammar", 0.044, 0.7, 0.25)
    assert isinstance(error, ResourceExhausted)
    assert str(error).startswith("structured.grammar: the grammar's work took 44.0 ms of CPU in one step")
    assert "700.0 ms in all, over the limit of 250 ms per step (--max-grammar-cpu-ms-per-step)" in str(error)
