"""Whether a flag's text is a list of token IDs ("1,2,3"), as `tandem generate` and `tandem embed`
take a prompt."""

from __future__ import annotations


def is_token_ids(text: str) -> bool:
    """ "1,2,3": comma-separated integers a token ID (a uint32) can hold."""
    # ASCII digits only (str.isdigit takes '²', which int() refuses, and '٣', which it reads), and
    # at most 10 of them before int(), which refuses over 4,300 digits in words of its own.
    ids = [i.strip() for i in text.split(",")]
    return all(i.isascii() and i.isdigit() and _below_2_32(i.lstrip("0") or "0") for i in ids)


def _below_2_32(digits: str) -> bool:
    return len(digits) <= 10 and int(digits) < 2**32  # leading zeros stripped: int() counts them
