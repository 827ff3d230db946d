"""field_path: a step into an object or a list, as every service's refusal spells it."""

from __future__ import annotations

import pytest

from tandem.client.field_path import MAX_KEY_CHARS, child_path, quoted_key


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("flag", "kw.flag"),
        ("_private", "kw._private"),
        ("a b", 'kw["a b"]'),
        ("1st", 'kw["1st"]'),
        ("", 'kw[""]'),
        ('say "hi"', 'kw["say \\"hi\\""]'),
        ("café au lait", 'kw["café au lait"]'),  # as written, not \u-escaped
        (3, "kw[3]"),
    ],
)
def test_an_identifier_key_is_dotted_any_other_is_quoted_and_an_index_is_bracketed(
    key: str | int, path: str
) -> None:
    assert child_path("kw", key) == path


def test_a_key_past_the_limit_is_cut_and_shows_it_was() -> None:
    whole = "k" * MAX_KEY_CHARS
    assert quoted_key(whole) == f'"{whole}"'
    assert quoted_key(whole + " more" * 200_000) == f'"{whole}..."'
    assert child_path("kw", "a" * (MAX_KEY_CHARS + 1)) == f'kw["{"a" * MAX_KEY_CHARS}..."]'
