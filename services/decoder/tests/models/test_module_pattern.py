"""peft's regular-expression target_modules matched in a worker: Python's re.fullmatch exactly, and a
pattern that does not compile, is too long, or backtracks past the deadline refused in one line."""

from __future__ import annotations

import re
import time

import pytest

from tandem.decoder.models.module_pattern import MAX_PATTERN_CHARS, PatternError, fullmatches

NAMES = [f"model.layers.{layer}.self_attn.{m}" for layer in range(3) for m in ("q_proj", "v_proj")] + [
    "lm_head"
]


@pytest.mark.parametrize(
    "pattern",
    [
        r".*\.(q_proj|v_proj)$",
        r"(?:.*?(?:language|text).*?)?model\.layers\.[01]\..*?q_proj",
        r"(?i)LM_HEAD|model\.layers\.2\.self_attn\.v_proj",
        "q_proj",  # fullmatch: no whole name is just this
    ],
)
def test_the_names_matched_are_those_re_fullmatch_finds(pattern: str) -> None:
    assert fullmatches(pattern, NAMES) == {name for name in NAMES if re.fullmatch(pattern, name)}


def test_a_pattern_that_backtracks_for_ever_is_cut_off_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(PatternError, match="within 0.5 s"):
        fullmatches(r"(.*.*.*.*.*)*x", NAMES, time_limit_s=0.5)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("(q_proj", "not a regular expression Python's re compiles: missing \\)"),
        ("a" * (MAX_PATTERN_CHARS + 1), f"at most {MAX_PATTERN_CHARS}"),
    ],
)
def test_a_pattern_that_cannot_be_matched_is_refused_in_one_line(pattern: str, says: str) -> None:
    with pytest.raises(PatternError, match=says) as raised:
        fullmatches(pattern, NAMES)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300
