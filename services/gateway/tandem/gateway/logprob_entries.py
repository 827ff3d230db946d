"""A TokenDelta's logprobs as OpenAI's entries: chat's `logprobs.content`, and the completions
endpoint's older lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

Each token and alternative is spelled from its own bytes (TokenDelta.token_bytes, TopLogprobs.token_bytes),
as vLLM's OpenAI server spells them: `token` the bytes as UTF-8 text, U+FFFD where a token holds part of
a character (vLLM's text for it too), and `bytes` the raw bytes (OpenAI's), so a client joins a split
character's bytes back. Never the delta's text cut up: a delta carries several tokens when the reader
fell behind or a step verified a proposal, so its text is no one token's, and entries cut from it
changed with the server's load.

A decoder older than token_bytes sends none: then a sampled token's text is its delta's text on the
delta's first token (one token a delta, the decoder's default) and every other token and alternative is
spelled `token_id:N` with null `bytes`, as vLLM's `return_tokens_as_token_ids` spells them.

`text_offset` counts the characters of the completion before each token: the characters its earlier
tokens' bytes complete, so a character split over tokens counts once, where it ends (`TextOffsets`).
"""

from __future__ import annotations

import codecs
from typing import Any

from tandem.client.pb.tandem.v1 import decoder_pb2

LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity: a token the model rules out gets this, as vLLM does


def logprob(value: float) -> float:
    return value if value > LOWEST_LOGPROB else LOWEST_LOGPROB  # NaN, too: never valid JSON


def token_text(token_bytes: bytes) -> str:
    """A token's `token`: its bytes as text, U+FFFD for each part of a character they hold."""
    return token_bytes.decode("utf-8", errors="replace")


def chat_logprobs(delta: decoder_pb2.TokenDelta) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` entries of one delta."""
    is_spelled = len(delta.token_bytes) == len(delta.token_ids)
    entries = []
    for k, (token_id, value) in enumerate(zip(delta.token_ids, delta.logprobs, strict=False)):
        if is_spelled:
            own: bytes | None = delta.token_bytes[k]
        else:  # an older decoder's delta: its text is its first token's
            own = delta.text.encode() if k == 0 and delta.text else None
        top = delta.top_logprobs[k] if k < len(delta.top_logprobs) else None
        entries.append(
            {
                "token": token_text(own) if own is not None else f"token_id:{token_id}",
                "logprob": logprob(value),
                "bytes": list(own) if own is not None else None,
                "top_logprobs": _alternatives(top) if top is not None else [],
            }
        )
    return entries


def _alternatives(top: decoder_pb2.TopLogprobs) -> list[dict[str, Any]]:
    if len(top.token_bytes) != len(top.token_ids):  # an older decoder's: spelled by ID
        return [
            {"token": f"token_id:{t}", "logprob": logprob(lp), "bytes": None}
            for t, lp in zip(top.token_ids, top.logprobs, strict=False)
        ]
    return [
        {"token": token_text(own), "logprob": logprob(lp), "bytes": list(own)}
        for own, lp in zip(top.token_bytes, top.logprobs, strict=False)
    ]


class TextOffsets:
    """A choice's `text_offset`s, token after token: the characters of the completion before each."""

    def __init__(self) -> None:
        self.position = 0  # characters completed so far
        # Bytes of a character not finished yet wait here for the token that ends it.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, entry: dict[str, Any]) -> int:
        """The offset of `entry` (a `chat_logprobs` entry); counts the characters it completes."""
        offset = self.position
        if entry["bytes"] is not None:  # a token spelled `token_id:N` is no text of the completion
            self.position += len(self._decoder.decode(bytes(entry["bytes"])))
        return offset


def text_logprobs(entries: list[dict[str, Any]], offsets: TextOffsets) -> dict[str, Any]:
    """The completions endpoint's older logprobs shape of `entries`; `offsets` carries on from the
    choice's entries before them."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": [offsets.advance(e) for e in entries],
    }
