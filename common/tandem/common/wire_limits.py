"""Limits of the wire contract that both services apply alike; a request past one is refused with
INVALID_ARGUMENT naming the field and the limit."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.client.errors import InvalidArgument
from tandem.common.model_name import check_label
from tandem.common.text_bounds import check_fits, min_positions, text_rule

MAX_REQUEST_ID_BYTES = 128  # `request_id`, UTF-8: a label echoed in every event, never looked up
MAX_TOKENIZE_TEXTS = 64  # `texts` of one Tokenize call: each is tokenized in full before the reply
# A chat template, a caller's or a GGUF file's, in characters: real ones are 1-10 KB (Qwen3's about 4),
# and a template is code that runs on every request that uses it.
MAX_TEMPLATE_CHARS = 64 * 1024


def check_request_id(request_id: str) -> None:
    """At most MAX_REQUEST_ID_BYTES, and a label (model_name.check_label): both services log and trace
    the ID as the caller sent it, so a line break in it would forge a log line. Raises InvalidArgument
    naming request_id."""
    num_bytes = len(request_id.encode())
    if num_bytes > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes of UTF-8, got {num_bytes}")
    check_label(request_id, "request_id")


def check_tokenize_texts(
    texts: Sequence[str], max_chars_per_token: int, max_positions: int, limit: str
) -> None:
    """A Tokenize call does at most the tokenizing one request may: at most MAX_TOKENIZE_TEXTS texts,
    which together must be able to fit `max_positions` (the service's `limit`, e.g. "max_model_len").
    Checked from counts and lengths alone, before anything is tokenized."""
    if len(texts) > MAX_TOKENIZE_TEXTS:
        raise InvalidArgument(
            "texts", f"{len(texts)} texts exceed the limit of {MAX_TOKENIZE_TEXTS} per call"
        )
    num_at_least = sum(min_positions(text, max_chars_per_token) for text in texts)
    check_fits(
        num_at_least,
        max_positions,
        "texts",
        text_rule(max_chars_per_token),
        f"{limit} {max_positions}",
        f"; tokenize at most {max_positions * max_chars_per_token} characters per call",
    )
