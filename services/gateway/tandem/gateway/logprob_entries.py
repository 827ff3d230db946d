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

The completions endpoint's `tokens` and `top_logprobs` keys are spelled as OpenAI's legacy API spells
them (`legacy_token`): a token whose bytes are not UTF-8 on their own (part of a character) is
`bytes:\\xe6\\x88`, each byte as \\xNN, so the alternatives that are parts of different characters keep
different keys; they were all U+FFFD and collapsed into one (SmolLM2 on a Chinese prompt, `logprobs` 5:
39 of 40 positions had fewer than 5). Each position's `top_logprobs` holds its sampled token first, at
the decoder's logprob for it, then the alternatives, as vLLM's and OpenAI's legacy API give them: N+1
keys for `logprobs: N` where the sampled token is not among the N likeliest. Two that still spell the
same key keep the first (the sampled token, then the likelier). Chat's `top_logprobs` are the
alternatives alone; its `token` stays the replacement-decoded text (vLLM's), its `bytes` the raw bytes.

`text_offset` counts the characters of the completion before each token: the characters its earlier
tokens' bytes complete, so a character split over tokens counts once, where it ends (`TextOffsets`).
"""

from __future__ import annotations

import codecs
import math
from typing import Any

from tandem.client.pb.tandem.v1 import decoder_pb2

LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity: a token the model rules out gets this, as vLLM does


def logprob(value: float) -> float:
    """A logprob as an answer shows it: -inf is LOWEST_LOGPROB, as vLLM's clamp makes it; any other
    value is itself, one below -9999.0 too (a finite logprob is the model's, and vLLM keeps it).

    NOTE: NaN never comes here. The decoder ends a request whose logits row holds NaN or +inf, sampled
    or scoring its prompt, with INTERNAL naming the position (its step/non_finite.py), before the
    row's logprobs are sent; a finite row's log-softmax is finite or -inf. It clamped NaN to -9999.0
    too, which would have shown a model's fault as a token it ruled out.
    """
    return LOWEST_LOGPROB if value == -math.inf else value


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


def legacy_token(entry: dict[str, Any]) -> str:
    """A completions `tokens` entry or `top_logprobs` key: the token's text, or `bytes:` and each of its
    bytes as \\xNN where they are not UTF-8 on their own (OpenAI's legacy spelling)."""
    if entry["bytes"] is None:  # spelled `token_id:N`, or an older decoder's text
        return str(entry["token"])
    return legacy_text(bytes(entry["bytes"]))


def legacy_text(own: bytes) -> str:
    """`legacy_token` of a token of bytes `own`."""
    try:
        return own.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in own)


class TextOffsets:
    """A choice's `text_offset`s, token after token: the characters of the completion before each.

    NOTE: counted from the tokens' bytes, and two things the emitted text does otherwise:
    - SentencePiece's detokenizer drops the leading space of the text's first token when nothing comes
      before it (after a control token, `<s>` alone): text "Hello world" of tokens b" Hello" b" world".
      The first token's space is not counted when the completion's text (`see`) does not start with
      one, so offsets index the text; its `bytes` stay the token's own. Until the text has a first
      character that cannot be told: a stream holds a chunk's entries back while its text is still
      empty (a stop string's prefix held back), and sends them with the text they index (`responses`).
    - bytes that are no character: Python's decoder counts one U+FFFD for each invalid run, the
      tokenizers library's ByteFallback one for each byte, so past such a run in a SentencePiece
      model's text the offsets fall short by the run's bytes less one. Left so: a model rarely emits
      them, and counting from the text would need the text's own split into tokens.
    """

    def __init__(self) -> None:
        self.position = 0  # characters completed so far
        # Bytes of a character not finished yet wait here for the token that ends it.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text_start = ""  # the completion's first character, once its text has one
        self._is_first = True  # no token with bytes counted yet

    def see(self, text: str) -> None:
        """The completion's text that comes with the next entries (the whole text, or a chunk's)."""
        if not self._text_start:
            self._text_start = text[:1]

    @property
    def has_text(self) -> bool:
        """Whether the completion's first character is known (the first token's offsets can be told)."""
        return bool(self._text_start)

    def advance(self, entry: dict[str, Any]) -> int:
        """The offset of `entry` (a `chat_logprobs` entry); counts the characters it completes."""
        offset = self.position
        if entry["bytes"] is not None:  # a token spelled `token_id:N` is no text of the completion
            own = bytes(entry["bytes"])
            if self._is_first and own.startswith(b" ") and self._text_start not in ("", " "):
                own = own[1:]  # the detokenizer dropped it (the class's NOTE)
            self._is_first = False
            self.position += len(self._decoder.decode(own))
        return offset


def text_logprobs(entries: list[dict[str, Any]], offsets: TextOffsets) -> dict[str, Any]:
    """The completions endpoint's older logprobs shape of `entries`; `offsets` carries on from the
    choice's entries before them, and has seen the text that comes with them."""
    return {
        "tokens": [legacy_token(e) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_keyed([e, *e["top_logprobs"]]) for e in entries],  # the sampled token first
        "text_offset": [offsets.advance(e) for e in entries],
    }


def _keyed(alternatives: list[dict[str, Any]]) -> dict[str, float]:
    """`top_logprobs` as the completions endpoint's dict; of two spelled alike, the first."""
    keyed: dict[str, float] = {}
    for alternative in alternatives:
        keyed.setdefault(legacy_token(alternative), alternative["logprob"])
    return keyed
