"""Tandem's Generate events -> OpenAI's response objects and stream chunks (chat and completions).

A `Completion` is one choice's answer, its chunks carrying its `index`; `answer` and `usage_chunk`
are the request's, over all of its choices. Usage counts as vLLM counts it: the completion tokens of
every choice, the prompt tokens once per prompt (n choices of one prompt read it once, in OpenAI's
accounting too).

Logprobs entries come from `logprob_entries`: each token spelled from its own bytes, as the decoder
sends them. Prompt logprobs (`prompt_logprobs.py`) are a completions choice's last key, and a chat
answer's own after its usage, as vLLM places them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.answer_bound import CHOICE_FRAME_BYTES, delta_bound, prompt_bound
from tandem.gateway.logprob_entries import TextOffsets, chat_logprobs, text_logprobs
from tandem.gateway.prompt_logprobs import prompt_entries

FINISH_REASONS = {
    decoder_pb2.FINISH_REASON_LENGTH: "length",
    decoder_pb2.FINISH_REASON_CONTEXT_LIMIT: "length",
    decoder_pb2.FINISH_REASON_EOS: "stop",
    decoder_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    decoder_pb2.FINISH_REASON_STOP_TOKEN: "stop",
}  # FINISH_REASON_ABORTED (the server drained) is no OpenAI reason: it is answered as a 503 (`aborted`)


def usage(completions: list[Completion]) -> dict[str, Any] | None:
    """OpenAI's usage of a request's choices (None while one has not finished): each prompt's tokens
    once (its first choice's count: every choice of a prompt reads the same), every choice's output."""
    if any(c.finished is None for c in completions):
        return None
    prompt = cached = completion = 0
    counted: set[int] = set()
    for c in completions:
        assert c.finished is not None
        completion += c.finished.usage.output_tokens
        if c.prompt_index not in counted:
            counted.add(c.prompt_index)
            prompt += c.finished.usage.input_tokens
            cached += c.finished.usage.cached_input_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Completion:
    """Accumulates one choice's events into OpenAI objects; `chunk` renders a stream event."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        index: int = 0,
        prompt_index: int = 0,
        created: int | None = None,
    ) -> None:
        self.kind = kind  # "chat" or "text"
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id  # the request's: every choice's
        self.model = model
        self.index = index  # OpenAI's choice index
        self.prompt_index = prompt_index  # which prompt of the body it answers
        self.created = int(time.time()) if created is None else created
        self.text: list[str] = []
        # The deltas of a non-streamed answer with logprobs, serialized (about 180 bytes a token with
        # 20 alternatives) until the answer is written, a choice at a time (`answers.write`): as
        # OpenAI's entries they took 6 KB a token, 816 MB for 16 choices of 8,192 tokens.
        self.deltas: list[bytes] = []
        self.finished: decoder_pb2.Finished | None = None
        # Its prompt's logprobs: the serialized delta that carried them (its first), or for a
        # completion's choice that did not ask, its prompt's choice's that did (`share_scores`).
        self.scored: bytes | None = None
        self.scored_bound = 0  # the most bytes they take in the answer (`answer_bound.prompt_bound`)
        # The most bytes this choice's JSON takes, from its tokens so far (`answer_bound`), its prompt
        # logprobs' among them once counted (`bound_scores`).
        self.json_bound = CHOICE_FRAME_BYTES
        self._text_chunk: tuple[str, str] | None = None  # a text chunk's JSON before and after its text
        self._offsets = TextOffsets()  # the streamed tokens' (completions' logprobs.text_offset)
        # A completions stream's entries sent before its text starts, held until it does (TextOffsets' NOTE):
        # counted then, "Hello world" of b" Hello" b" world" streamed text_offset [0, 6], whole [0, 5].
        self._held: list[dict[str, Any]] = []

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def head(self, streamed: bool) -> dict[str, Any]:
        """The fields every response and chunk of the request opens with."""
        kind = "chat.completion.chunk" if streamed and self.kind == "chat" else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def add(self, delta: decoder_pb2.TokenDelta, with_logprobs: bool) -> None:
        self.text.append(delta.text)
        self.json_bound += delta_bound(delta, self.kind, with_logprobs)
        data = delta.SerializeToString() if with_logprobs or delta.prompt_logprobs else b""
        if with_logprobs:
            self.deltas.append(data)
        if delta.prompt_logprobs:
            # The delta's own bytes, one object with its entry in `deltas` (whose reader skips them): a
            # copy of them alone took 22 ms for 8,192 positions of 21 entries, on the event loop.
            # Their bound is `bound_scores`', a slice of positions at a time.
            self.scored = data

    async def bound_scores(self, delta: decoder_pb2.TokenDelta) -> None:
        """Counts the most bytes the prompt logprobs of `delta`, added (`add`), take in the answer."""
        self.scored_bound = await prompt_bound(delta)
        self.json_bound += self.scored_bound

    def logprobs(self) -> list[dict[str, Any]]:
        """OpenAI's logprobs entries of every token so far (`chat_logprobs`)."""
        return [
            entry for data in self.deltas for entry in chat_logprobs(decoder_pb2.TokenDelta.FromString(data))
        ]

    @property
    def aborted(self) -> bool:
        return self.finished is not None and self.finished.reason == decoder_pb2.FINISH_REASON_ABORTED

    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.finished.reason) if self.finished is not None else None

    def choice(self, with_logprobs: bool, with_scores: bool = True) -> dict[str, Any]:
        """This choice in the non-streamed response (`with_scores`: with its prompt logprobs, if any)."""
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason()}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = {"content": self.logprobs()} if with_logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = text_logprobs(self.logprobs(), _offsets_of(text)) if with_logprobs else None
            if self.scored is not None and with_scores:
                choice["prompt_logprobs"] = prompt_entries(self.scored)
        return choice

    def chunk(
        self, delta: decoder_pb2.TokenDelta | None, with_logprobs: bool, first: bool = False
    ) -> dict[str, Any]:
        """A stream chunk: a delta's text, or (`delta` None) the closing one with the finish reason."""
        text = delta.text if delta is not None else ""
        choice: dict[str, Any] = {
            "index": self.index,
            "finish_reason": None if delta is not None else self.finish_reason(),
        }
        logprobs = chat_logprobs(delta) if delta is not None and with_logprobs else None
        if self.kind == "chat":
            choice["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": text} if delta or first else {}
            )
            choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
        else:
            choice["text"] = text
            self._offsets.see(text)
            held, self._held = self._held, []
            entries = held + logprobs if logprobs is not None else held or None
            if delta is not None and entries and not self._offsets.has_text:
                self._held, entries = entries, []  # sent with the text they index, or the closing chunk
            choice["logprobs"] = text_logprobs(entries, self._offsets) if entries is not None else None
        return self.head(streamed=True) | {"choices": [choice]}

    def text_chunk(self, text: str) -> str:
        """`chunk` of a delta without logprobs, serialized: all of it but the text is the same for every
        token of the request, so that part is built once (a third of the gateway's time per token at
        32 streams went to building and dumping the same dict)."""
        if self._text_chunk is None:
            marker = "\x00tandem-text\x00"
            whole = json.dumps(self.chunk(decoder_pb2.TokenDelta(text=marker), False), separators=(",", ":"))
            before, after = whole.split(json.dumps(marker))
            self._text_chunk = (before, after)
        before, after = self._text_chunk
        return before + json.dumps(text) + after

    def opening_chunk(self) -> dict[str, Any]:
        """A chat choice's first chunk: the assistant's role, before any text."""
        opening = {"index": self.index, "delta": {"role": "assistant", "content": ""}}
        return self.chunk(None, False, first=True) | {
            "choices": [opening | {"logprobs": None, "finish_reason": None}]
        }


def share_scores(completions: list[Completion]) -> None:
    """Each completions choice gets its prompt's logprobs from the prompt's choice that asked for
    them (`choices.py`), and counts their bytes; a chat answer shows its one choice's once."""
    scorers = {c.prompt_index: c for c in completions if c.scored is not None}
    for completion in completions:
        scorer = scorers.get(completion.prompt_index)
        if completion.kind == "text" and completion.scored is None and scorer is not None:
            completion.scored, completion.scored_bound = scorer.scored, scorer.scored_bound
            completion.json_bound += scorer.scored_bound


def answer(completions: list[Completion], with_logprobs: bool) -> dict[str, Any]:
    """The non-streamed response of a request's choices (`completions`, in index order)."""
    body = completions[0].head(streamed=False)
    body["choices"] = [c.choice(with_logprobs) for c in completions]
    if (counted := usage(completions)) is not None:
        body["usage"] = counted
    if completions[0].kind == "chat" and completions[0].scored is not None:
        body["prompt_logprobs"] = prompt_entries(completions[0].scored)
    return body


def answer_frame(completions: list[Completion], with_scores: bool = True) -> tuple[str, str]:
    """`answer`'s JSON before and after its choices (joined by ", "), so that each choice can be
    serialized on its own: `before + ", ".join(choices) + after` is json.dumps(answer(...)). Without
    `with_scores`, a chat answer's prompt logprobs are left out (the last key: `answers.write` renders
    them a slice at a time before the closing brace)."""
    marker = "\x00tandem-choices\x00"
    body = completions[0].head(streamed=False) | {"choices": marker}
    if (counted := usage(completions)) is not None:
        body["usage"] = counted
    before, after = json.dumps(body).rsplit(json.dumps(marker), 1)  # the model's name comes before
    if with_scores and completions[0].kind == "chat" and completions[0].scored is not None:
        after = after[:-1] + ', "prompt_logprobs": ' + json.dumps(prompt_entries(completions[0].scored)) + "}"
    return before + "[", "]" + after


def usage_chunk(completions: list[Completion]) -> dict[str, Any]:
    """A stream's last chunk (stream_options.include_usage): the usage of every choice, no choices."""
    return completions[0].head(streamed=True) | {"choices": [], "usage": usage(completions)}


def _offsets_of(text: str) -> TextOffsets:
    """Offsets that count into `text`, the whole completion's."""
    offsets = TextOffsets()
    offsets.see(text)
    return offsets
