"""Which prompt text is token IDs."""

from __future__ import annotations

import pytest

from tandem.common.token_ids_text import is_token_ids


@pytest.mark.parametrize("text", ["1,2,3", "0", " 7 , 8", "4294967295", "0004294967295", "0" * 5000 + "5"])
def test_token_ids_are_comma_separated_integers_a_uint32_holds(text: str) -> None:
    assert is_token_ids(text)


@pytest.mark.parametrize(
    "text", ["", "1,,2", "-1", "4294967296", "1.5", "x", "\u00b2", "1,\u0663", "9" * 5000, "1e3"]
)
def test_anything_else_is_not_token_ids(text: str) -> None:
    """'²' raised int()'s ValueError (a traceback from tandem generate and embed), '٣' was taken as
    3, 5,000 digits raised int()'s limit on digits."""
    assert not is_token_ids(text)
