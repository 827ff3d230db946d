"""Non-finite rows in a step's samples: where a request's tokens stop and what its error says."""

from __future__ import annotations

from tandem.client.errors import ModelFault
from tandem.decoder.engine.sampling.prompt_lookup import verified_tokens
from tandem.decoder.engine.step.non_finite import (
    NON_FINITE,
    at_output,
    at_prompt,
    cut_at_non_finite,
    mark_non_finite,
)


def test_a_non_finite_rows_sample_is_marked_and_the_others_kept() -> None:
    assert mark_non_finite([5, 6, 7], [True, False, True]) == [5, NON_FINITE, 7]


def test_a_plain_request_whose_row_is_non_finite_keeps_no_token_and_fails_at_its_next_position() -> None:
    assert cut_at_non_finite(verified_tokens([], [NON_FINITE])) == ([], 0)
    assert cut_at_non_finite(verified_tokens([], [9])) == ([9], None)


def test_a_verification_stops_at_its_first_non_finite_row_even_where_the_garbage_matched() -> None:
    proposal = [4, 5, 6]
    # Rows 0 and 1 accept 4 and 5; row 2 is non-finite; row 3 would have matched too.
    samples = mark_non_finite([4, 5, 6, 8], [True, True, False, True])
    assert cut_at_non_finite(verified_tokens(proposal, samples)) == ([4, 5], 2)


def test_a_non_finite_row_after_a_rejection_is_never_reached() -> None:
    samples = mark_non_finite([4, 9, 6, 8], [True, True, False, False])  # 9 rejects the proposal's 5
    assert cut_at_non_finite(verified_tokens([4, 5, 6], samples)) == ([4, 9], None)


def test_the_errors_are_internal_and_name_the_position() -> None:
    assert isinstance(at_output(3), ModelFault) and "output position 3" in at_output(3).message
    assert "prompt position 7" in at_prompt(7).message and "prompt_logprobs" in at_prompt(7).message


def test_the_errors_name_the_adapter_a_request_ran_on_as_the_likelier_cause() -> None:
    assert "with LoRA adapter 'big' (its update may overflow" in at_output(3, "big").message
    assert "with LoRA adapter 'big'" in at_prompt(7, "big").message
    assert "adapter" not in at_output(3).message + at_prompt(7, "").message
