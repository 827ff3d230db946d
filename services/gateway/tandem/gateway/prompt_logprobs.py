"""vLLM's `prompt_logprobs` extra parameter: the body's field read and bounded, and the decoder's
PromptLogprob entries as vLLM's OpenAI server shows them.

The shape (vLLM's `PromptLogprobs`): a list with one item per prompt position, `null` at position 0
(nothing comes before it), then a dict mapping each token ID, as a string, to `{"logprob", "rank",
"decoded_token"}`: the prompt's own token there first, then the position's N likeliest tokens, N the
body's value, their ranks 1 to N. A token both the prompt's and among the likeliest is one key, as in
vLLM. An embedding row has no token: its dict holds the likeliest alone. `decoded_token` is the token's
own bytes as text, U+FFFD for part of a character (vLLM's decode of the one token; `null` from a decoder
older than PromptLogprob.token_bytes); a logprob of -inf is -9999.0, as vLLM's clamp_prompt_logprobs
makes it. The prompt token's `rank` is its place in the whole vocabulary, one more than the tokens
strictly likelier (the decoder's PromptLogprob.rank), among the N likeliest or not. Where it is among
them its key is the likeliest's entry, ranked by its place in the list, as vLLM's dict keeps the later
value of a repeated key. The two counts differ only at an exact tie of logprobs: vLLM's takes tokens
tied with the prompt's for likelier. From a decoder older than PromptLogprob.rank, a prompt token not
among the N likeliest has `rank` null, as vLLM's optional `Logprob.rank` allows.

Where vLLM puts them: each choice's `prompt_logprobs` on /v1/completions (each choice of a prompt has
its prompt's), the response's own on /v1/chat/completions. Not with `stream: true`, as vLLM refuses it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.fields import field, shown
from tandem.gateway.logprob_entries import logprob, token_text

# The decoder's bound on the likeliest tokens each position lists (OutputOptions.prompt_logprobs),
# the one `logprobs` and `top_logprobs` have too. vLLM's -1 (the whole vocabulary) is refused: a
# position of SmolLM2's would be 49,152 entries.
MAX_PROMPT_LOGPROBS = 20
# Positions rendered and dumped between two yields of the event loop (`prompt_json`): at most 21
# entries each, about as many values as `choice_json.SLICE_VALUES`.
SLICE_POSITIONS = 48


def prompt_logprobs(body: dict[str, Any], request: decoder_pb2.GenerateRequest) -> None:
    """The body's `prompt_logprobs`, into `request`'s output options; refused outside [0, 20] and with
    `stream: true`."""
    value = field(body, "prompt_logprobs", int)
    if value is None:
        return
    if not 0 <= value <= MAX_PROMPT_LOGPROBS:
        raise InvalidArgument(
            "prompt_logprobs",
            f"must be in [0, {MAX_PROMPT_LOGPROBS}] (the likeliest tokens listed per prompt position; "
            f"vLLM's -1, the whole vocabulary, is not supported), got {shown(value)}",
        )
    if body.get("stream") is True:
        # vLLM's rule, stricter: it lets 0 through with a stream and sends no prompt logprobs.
        raise InvalidArgument("prompt_logprobs", "is not available with stream: true (as in vLLM)")
    request.output.prompt_logprobs = value


def prompt_entries(scored: bytes) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of `scored`, the serialized delta that carried them."""
    positions = decoder_pb2.TokenDelta.FromString(scored).prompt_logprobs
    return [_position(p) if k else None for k, p in enumerate(positions)]


def _position(position: decoder_pb2.PromptLogprob) -> dict[str, Any]:
    top = position.top_logprobs
    is_spelled = len(top.token_bytes) == len(top.token_ids)
    entries: dict[str, Any] = {}
    if position.HasField("token_id"):
        rank = position.rank if position.HasField("rank") else None
        own = position.token_bytes if position.HasField("token_bytes") else None
        entries[str(position.token_id)] = _entry(position.logprob, rank, own)
    # Among the likeliest, the prompt's token keeps its first place and takes its entry there (vLLM's).
    for k, (token_id, value) in enumerate(zip(top.token_ids, top.logprobs, strict=False)):
        entries[str(token_id)] = _entry(value, k + 1, top.token_bytes[k] if is_spelled else None)
    return entries


def _entry(value: float, rank: int | None, own: bytes | None) -> dict[str, Any]:
    return {
        "logprob": logprob(value),
        "rank": rank,
        "decoded_token": token_text(own) if own is not None else None,
    }


async def prompt_json(scored: bytes, on_piece: Callable[[int], None]) -> list[bytes]:
    """`prompt_entries(scored)` as JSON, in pieces whose concatenation is its json.dumps, rendered
    SLICE_POSITIONS positions at a time with the event loop let go between slices (`choice_json`'s
    NOTE: 8,192 positions of 21 entries are 172,000 values); `on_piece(num_bytes)` is told of each."""
    positions = decoder_pb2.TokenDelta.FromString(scored).prompt_logprobs
    pieces = [b"["]
    for lo in range(0, len(positions), SLICE_POSITIONS):
        entries = [
            _position(p) if lo + k else None for k, p in enumerate(positions[lo : lo + SLICE_POSITIONS])
        ]
        pieces.append((", " if lo else "").encode() + json.dumps(entries)[1:-1].encode())
        on_piece(len(pieces[-1]))
        await asyncio.sleep(0)
    pieces.append(b"]")
    on_piece(2)
    return pieces
