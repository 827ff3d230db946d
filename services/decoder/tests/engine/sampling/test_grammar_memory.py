"""What live matchers may hold: each charged when built, refused past its caller's or the engine's
limit naming its field, given back when its request's constraint goes."""

from __future__ import annotations

import pytest

from tandem.client.errors import ErrorInfo, InvalidArgument, ResourceExhausted
from tandem.decoder.engine.sampling.grammar_memory import (
    MAX_BYTES,
    MAX_BYTES_PER_CALLER,
    MIB,
    MIN_MATCHER_BYTES,
    GrammarMemoryBudget,
    estimated_bytes,
)


def test_a_matcher_is_charged_its_floor_plus_what_its_build_took() -> None:
    assert estimated_bytes(0.0) == MIN_MATCHER_BYTES
    # a{300}{190}: 20.3 MB measured, built in 56-69 ms of CPU: charged more than that at the fastest
    assert estimated_bytes(0.056) > 20.3e6 > estimated_bytes(0.0)


def test_256_ordinary_schemas_of_one_caller_are_never_refused() -> None:
    budget = GrammarMemoryBudget()
    ordinary = estimated_bytes(0.002)  # 0.5-0.8 ms of building measured
    for _ in range(256):
        budget.reserve("gateway", "structured.json_schema", ordinary)
    assert budget.held("gateway") == 256 * ordinary < min(MAX_BYTES, MAX_BYTES_PER_CALLER)


def test_one_caller_past_its_limit_is_refused_naming_the_field_and_the_limit_and_others_go_on() -> None:
    budget = GrammarMemoryBudget(max_bytes=100 * MIB, max_bytes_per_caller=10 * MIB)
    budget.reserve("a", "structured.regex", 8 * MIB)
    with pytest.raises(
        ResourceExhausted, match=r"structured\.regex: .* the limit is 10 MiB per caller"
    ) as caught:
        budget.reserve("a", "structured.regex", 4 * MIB)
    assert caught.value.info == ErrorInfo(
        "GRAMMAR_MEMORY",
        "tandem.decoder",
        {
            "scope": "caller",
            "heldBytes": str(8 * MIB),
            "neededBytes": str(4 * MIB),
            "maxBytes": str(10 * MIB),
        },
    )
    budget.reserve("b", "structured.regex", 8 * MIB)
    assert (budget.held("a"), budget.held("b"), budget.held()) == (8 * MIB, 8 * MIB, 16 * MIB)


def test_the_engines_limit_counts_every_caller() -> None:
    budget = GrammarMemoryBudget(max_bytes=10 * MIB, max_bytes_per_caller=10 * MIB)
    budget.reserve("a", "structured.regex", 6 * MIB)
    with pytest.raises(
        ResourceExhausted, match=r"structured\.grammar: .* the limit is 10 MiB in all"
    ) as caught:
        budget.reserve("b", "structured.grammar", 6 * MIB)
    assert caught.value.info is not None
    assert (caught.value.info.reason, caught.value.info.metadata["scope"]) == ("GRAMMAR_MEMORY", "decoder")


def test_a_release_gives_back_exactly_its_charge() -> None:
    budget = GrammarMemoryBudget(max_bytes=10 * MIB, max_bytes_per_caller=10 * MIB)
    release = budget.reserve("a", "structured.regex", 6 * MIB)
    budget.reserve("a", "structured.regex", 1 * MIB)
    release()
    assert (budget.held("a"), budget.held()) == (1 * MIB, 1 * MIB)
    budget.reserve("b", "structured.regex", 9 * MIB)


def test_a_matcher_over_a_limit_alone_is_invalid_not_a_retry_that_could_never_succeed() -> None:
    budget = GrammarMemoryBudget(max_bytes=100 * MIB, max_bytes_per_caller=10 * MIB)
    with pytest.raises(
        InvalidArgument, match=r"its matcher alone needs about 11 MiB .* over the 10 MiB"
    ) as caught:
        budget.reserve("a", "structured.regex", 11 * MIB)
    assert caught.value.field == "structured.regex" and budget.held() == 0
    budget.reserve("a", "structured.regex", 10 * MIB)  # exactly the limit still fits
