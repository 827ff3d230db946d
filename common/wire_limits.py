"""Limits of the wire contract that both services apply alike; a request past one is refused with
INVALID_ARGUMENT naming the field and the limit."""

from __future__ import annotations

MAX_REQUEST_ID_BYTES = 128  # `request_id`, UTF-8: a label echoed in every event, never looked up
MAX_TOKENIZE_TEXTS = 64  # `texts` of one Tokenize call: each is tokenized in full before the reply
