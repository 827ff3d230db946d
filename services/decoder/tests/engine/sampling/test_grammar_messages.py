"""llguidance's messages in ours: markers and backtraces left out, the limits it hit named."""

from __future__ import annotations

import logging

import pytest

from tandem.decoder.engine.sampling.grammar_limits import MAX_GRAMMAR_SIZE, MAX_LEXER_FUEL
from tandem.decoder.engine.sampling.grammar_messages import in_our_words, llguidance_reason


def test_markers_and_empty_words_leave_nothing_to_say() -> None:
    assert llguidance_reason("<non-verbose/> no error message.") == ""
    assert llguidance_reason("<non-verbose/>lexer error: too many states; ") == "lexer error: too many states"


def test_a_panics_first_line_is_told_and_its_backtrace_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        reason = llguidance_reason("panic: assertion failed<backtrace>0: /build/llguidance/src/lib.rs:1")
    assert reason == "panic: assertion failed"
    assert "/build/llguidance/src/lib.rs" in caplog.text


def test_a_long_message_is_cut_to_300_characters_on_one_line() -> None:
    assert llguidance_reason("a\n" * 400) == " ".join(["a"] * 150)


@pytest.mark.parametrize(
    ("reason", "names"),
    [
        ("lexer error: too many expressions constructed", f"{MAX_LEXER_FUEL:,} steps"),
        ("schema too large", f"max_grammar_size of {MAX_GRAMMAR_SIZE:,}"),
        ("Too many items (limit 2000; ff_tokens)", "admits no finite answer"),
    ],
)
def test_a_limit_llguidance_hit_is_said_naming_the_limit(reason: str, names: str) -> None:
    said = in_our_words(reason)
    assert said is not None and names in said


def test_a_reason_that_is_no_limit_of_ours_is_left_as_llguidance_said_it() -> None:
    assert in_our_words("expected one of: NUMBER") is None
