"""The most bytes of JSON a non-streamed completion answer can take, reckoned from its request before
any decoder call: what the gateway reserves for it among the answers it holds (`answer_bytes`).

NOTE: what the bound assumes. Every part of a choice's JSON is bounded by the request but its text:
a token's logprobs entry is at most `ENTRY_BYTES` (its token spelled `token_id:N` with N of 10 digits,
a logprob of float32's longest repr, 23 characters) and each alternative at most `ALTERNATIVE_BYTES`,
the completions endpoint's shape being shorter in each part than chat's. A token's text has no bound
of its own (a vocabulary entry may be a long run of spaces), so the bound assumes a choice's text
averages at most `TEXT_BYTES_PER_TOKEN` UTF-8 bytes a token, each byte at most 6 characters of JSON
(\\u00XX; a character of 2 to 4 bytes takes 6 or 12) and, in chat's logprobs, the token's text once
more and its "bytes" list (at most "255, " a byte). English averages about 4 bytes a token, CJK 3 to
6; a choice whose text averages more than 8 bytes a token may pass its reservation by the excess,
which the gateway then counts as it serializes (`Reservation.hold`).
"""

from __future__ import annotations

import json

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.calls import GenerateCall

# {"token": "token_id:4294967295", "logprob": -1.0649640863824063e-32, "bytes": null, "top_logprobs": []}
# and its separator: a sampled token's chat entry, its text apart.
ENTRY_BYTES = 105
# {"token": "token_id:4294967295", "logprob": -1.0649640863824063e-32, "bytes": null} and its separator.
ALTERNATIVE_BYTES = 85
TEXT_BYTES_PER_TOKEN = 8  # assumed, averaged over a choice (see the note)
ESCAPED_BYTES = 6  # JSON characters of one UTF-8 byte, at most
BYTE_LIST_BYTES = 5  # "255, ": one byte in an entry's "bytes" list, at most
# A choice's keys, index and finish reason around its text and logprobs lists, and its separator.
CHOICE_FRAME_BYTES = 256
# The answer's id, object, created and usage around its choices (the model's name apart).
ANSWER_FRAME_BYTES = 512


def answer_bound(call: GenerateCall, model: str, max_context_tokens: int) -> int:
    """The most bytes `call`'s non-streamed answer takes as JSON, by the note's assumption on text."""
    num_bytes = ANSWER_FRAME_BYTES + len(json.dumps(model))
    for generate in call.requests:
        num_bytes += call.n * choice_bound(generate, max_context_tokens)
    return num_bytes


def choice_bound(generate: decoder_pb2.GenerateRequest, max_context_tokens: int) -> int:
    """The most bytes one choice of `generate` takes: its most tokens (max_new_tokens, else what the
    context leaves after the prompt's known positions) x the most bytes a token takes."""
    num_tokens = max(max_context_tokens - _known_positions(generate), 0)
    if generate.stopping.HasField("max_new_tokens"):
        num_tokens = min(num_tokens, generate.stopping.max_new_tokens)
    text = TEXT_BYTES_PER_TOKEN * ESCAPED_BYTES  # the choice's text (message.content, or text)
    per_token = text
    if generate.output.logprobs:  # the entry, its alternatives, its token's text again and its bytes
        per_token += ENTRY_BYTES + generate.output.top_logprobs * ALTERNATIVE_BYTES
        per_token += text + TEXT_BYTES_PER_TOKEN * BYTE_LIST_BYTES
    return CHOICE_FRAME_BYTES + num_tokens * per_token


def _known_positions(generate: decoder_pb2.GenerateRequest) -> int:
    """The prompt's positions the gateway can count without a tokenizer: its token IDs and embedding
    rows, at least one (a text or a chat takes one or more)."""
    num_positions = 0
    for segment in generate.prompt:
        if segment.HasField("token_ids"):
            num_positions += len(segment.token_ids.ids)
        elif segment.HasField("embeddings") and segment.embeddings.shape:
            num_positions += segment.embeddings.shape[0]
    return max(num_positions, 1)
