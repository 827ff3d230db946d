"""The length bound on text: never above what tokenizing gives, so it only refuses what cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.client.errors import InvalidArgument
from tandem.common.text_bounds import check_fits, max_token_chars, min_positions, text_rule, vocabulary_bound


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def test_a_byte_level_vocabulary_counts_one_character_per_byte(tokenizer: tokenizers.Tokenizer) -> None:
    longest = max(tokenizer.get_vocab(with_added_tokens=True), key=len)
    assert max_token_chars(tokenizer) == len(longest)


def test_other_vocabularies_count_utf8_bytes() -> None:
    assert vocabulary_bound(["ab", "▁x"], is_byte_level=False) == 4  # "▁" is 3 bytes
    assert vocabulary_bound([], is_byte_level=True) == 1


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=400))
def test_the_bound_never_exceeds_the_real_token_count(tokenizer: tokenizers.Tokenizer, text: str) -> None:
    bound = min_positions(text, max_token_chars(tokenizer))
    assert bound <= len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_what_cannot_fit_is_refused_naming_the_field_and_the_limit() -> None:
    check_fits(8, max_positions=8, field="text", counted=text_rule(10), limit="max_input_tokens 8")
    with pytest.raises(InvalidArgument) as info:
        check_fits(9, max_positions=8, field="text", counted=text_rule(10), limit="max_input_tokens 8")
    assert info.value.field == "text"
    assert info.value.description == (
        "at least 9 positions (text takes one per 10 characters or fewer) exceed max_input_tokens 8"
    )
