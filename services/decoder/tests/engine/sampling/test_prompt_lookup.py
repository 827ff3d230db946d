"""Prompt lookup: what follows the latest earlier occurrence of the history's last 1-4 tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.decoder.engine.sampling.prompt_lookup import PromptLookup, verified_tokens


def _lookup(tokens: list[int], is_token: list[bool] | None = None) -> PromptLookup:
    return PromptLookup(tokens, is_token if is_token is not None else [True] * len(tokens))


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_proposed() -> None:
    lookup = _lookup([1, 2, 3, 4, 5, 6, 9, 2, 3])
    assert lookup.propose(3) == [4, 5, 6]
    assert lookup.propose(10) == [4, 5, 6, 9, 2, 3]  # up to the end of the history


def test_the_longest_matching_suffix_wins_then_the_latest_occurrence() -> None:
    # "7 2 3" occurred once (followed by 8); "2 3" also occurred later (followed by 4).
    lookup = _lookup([7, 2, 3, 8, 1, 2, 3, 4, 0, 7, 2, 3])
    assert lookup.propose(1) == [8]
    assert _lookup([2, 3, 8, 1, 2, 3, 4, 0, 2, 3]).propose(1) == [4]


def test_one_matching_token_is_used_when_no_longer_suffix_matches() -> None:
    assert _lookup([5, 6, 7, 8, 5]).propose(3) == [6, 7, 8]
    # A longer match wins over the latest single token: "9 5" was followed by 1, "5" lastly by 6.
    assert _lookup([9, 5, 1, 2, 5, 6, 0, 9, 5]).propose(1) == [1]
    assert PromptLookup([5, 6, 7, 8, 5], [True] * 5, ngram_min=2).propose(3) == []


def test_sampled_tokens_extend_the_history_and_its_index() -> None:
    lookup = _lookup([1, 2, 3, 4])
    assert lookup.propose(2) == []
    lookup.extend([9, 1, 2])
    assert lookup.propose(2) == [3, 4]
    lookup.extend([3, 4, 9])  # the output repeats itself: its own earlier tokens match too
    assert lookup.propose(3) == [1, 2, 3]


def test_embedding_positions_match_nothing_and_end_a_proposal() -> None:
    #   positions:  0  1  2  3(emb) 4  5  6  7
    tokens = [1, 2, 3, 0, 4, 1, 2, 0]
    is_token = [True, True, True, False, True, True, True, False]
    lookup = _lookup(tokens[:7], is_token[:7])
    assert lookup.propose(4) == [3]  # "1 2" -> 3, then the embedding row ends the proposal
    # An embedding row inside the suffix: no n-gram ends with it.
    assert _lookup(tokens, is_token).propose(4) == []
    # Placeholder IDs (0) at embedding positions never match a real token 0.
    assert _lookup([0, 0, 7, 0], [False, False, True, True]).propose(2) == []


def test_a_zero_budget_proposes_nothing() -> None:
    assert _lookup([1, 2, 1, 2]).propose(0) == []


def test_verification_keeps_the_samples_up_to_the_first_that_differs() -> None:
    assert verified_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all right, plus the next
    assert verified_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the sample replaces the miss
    assert verified_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert verified_tokens([], [4]) == [4]
    with pytest.raises(ValueError, match="3 proposed tokens need 4 samples"):
        verified_tokens([5, 6, 7], [5, 6, 7])


@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 8))
def test_a_proposal_always_continues_a_real_earlier_occurrence(history: list[int], k: int) -> None:
    """Whatever the history, a proposal is the continuation of an earlier occurrence of its last
    n >= 1 tokens (checked by brute force), and incremental indexing equals indexing at once."""
    incremental = _lookup(history[:1])
    for token in history[1:]:
        incremental.propose(k)
        incremental.extend([token])
    proposal = _lookup(history).propose(k)
    assert incremental.propose(k) == proposal
    if proposal:
        assert any(
            history[start - n : start] == history[-n:] and history[start : start + len(proposal)] == proposal
            for n in range(1, 5)
            for start in range(n, len(history))
        )
