"""Whether a request's prompt-logprob delta can fit in one message of its front's (--max-message-bytes).

NOTE: why at admission. A request's prompt logprobs go out as one delta, built only once its whole
prompt has run; one over gRPC's message limit failed there, after the prefill (8.8 s of it in review),
with grpc's own "Sent message larger than max" (RESOURCE_EXHAUSTED). Its size is known closely enough
before any position runs: each position's entry holds the prompt's own token (known now: its ID and
bytes, `outputs/token_bytes.py`), its logprob and rank, and n alternatives, each an ID, a logprob and
the token's own bytes, none longer than the table's longest. So a request whose bound is over the
limit is refused INVALID_ARGUMENT, naming output.prompt_logprobs, and nothing runs; one whose bound
fits is sent whole.

The bound is the delta's proto3 wire size (tandem.v1 GenerateResponse) at its worst: the prompt's own
tokens as they are, and at every position the rank as long as the vocabulary's size and the n
alternatives the n longest tokens (they are n distinct tokens) with IDs as long as the largest ID;
every length prefix as long as the largest length it can hold, the longest request ID, and the tokens
sampled with it (`MAX_TOKENS_WITH_SCORES`). Only the last is reasoned from outside this module; the
test builds deltas of the longest tokens and checks the bound against their serialized sizes. Of a
prompt's own tokens the bound is exact, so it is closest for few alternatives; with n of 20 the
alternatives' worst (20 longest tokens: 1,250 bytes of SmolLM2's) is most of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import compress

from tandem.client.errors import InvalidArgument
from tandem.common.wire_limits import MAX_REQUEST_ID_BYTES
from tandem.decoder.config import MAX_SPECULATIVE_TOKENS
from tandem.decoder.engine.outputs.backpressure import MAX_STREAM_INTERVAL, MAX_UNREAD_TOKENS
from tandem.decoder.engine.outputs.token_bytes import TokenBytes
from tandem.decoder.engine.params import MAX_TOP_LOGPROBS

_TAG = 1  # every field number here is below 16: a one-byte tag
_FLOAT = 4
# Tokens the prompt-logprob delta may carry besides its entries: the steps one delta coalesces
# (stream_interval) and the step in flight when it is handed, each its token and the proposals it
# accepted, and what a lagging reader's stream merges into it before the request pauses
# (outputs/backpressure.py: past MAX_UNREAD_TOKENS untaken). A request asking fewer is bounded by
# its max_new_tokens instead.
MAX_TOKENS_WITH_SCORES = (MAX_STREAM_INTERVAL + 1) * (1 + MAX_SPECULATIVE_TOKENS) + MAX_UNREAD_TOKENS
# A token's text in a delta: at most 3 bytes a byte of its own (a lone byte of a partial character
# shown as U+FFFD's 3).
_TEXT_BYTES_PER_TOKEN_BYTE = 3


def varint_size(value: int) -> int:
    """Bytes of `value` (>= 0) as a protobuf varint."""
    return max(1, (value.bit_length() + 6) // 7)


def _field(payload: int) -> int:
    """A length-delimited field (message, bytes, packed) holding `payload` bytes."""
    return _TAG + varint_size(payload) + payload


def _own_token(token_id: int, own: bytes) -> int:
    """A PromptLogprob's token_id and token_bytes fields: what the prompt's own token takes."""
    return (_TAG + varint_size(token_id)) + _field(len(own))


@dataclass(frozen=True)
class PromptLogprobSize:
    """Upper bounds of a prompt-logprob delta's wire size from one tokenizer's token bytes."""

    # longest[k] = bytes of the k longest tokens together, k = 0 .. MAX_TOP_LOGPROBS + 1
    longest: tuple[int, ...]
    # own[t] = _own_token(t, its bytes) for each token ID t of the model's vocabulary (an ID past the
    # tokenizer's entries is spelled by no bytes)
    own: tuple[int, ...]

    @staticmethod
    def of(token_bytes: TokenBytes, vocab_size: int) -> PromptLogprobSize:
        lengths = sorted((len(own) for own in token_bytes.table), reverse=True)[: MAX_TOP_LOGPROBS + 1]
        sums = [0]
        for length in lengths + [0] * (MAX_TOP_LOGPROBS + 1 - len(lengths)):
            sums.append(sums[-1] + length)
        spelled = token_bytes.of(range(vocab_size))
        return PromptLogprobSize(tuple(sums), tuple(_own_token(t, own) for t, own in enumerate(spelled)))

    @cached_property
    def _id(self) -> int:
        """The most bytes a token ID takes: the vocabulary's last."""
        return varint_size(len(self.own) - 1)

    @cached_property
    def _max_own(self) -> int:
        """The most bytes a prompt's own token takes in its entry."""
        return max(self.own, default=0)

    def _alternatives(self, top: int) -> int:
        """A TopLogprobs of `top` tokens: their IDs and logprobs packed, and each one's bytes."""
        return (
            _field(self._id * top)
            + _field(_FLOAT * top)
            + top * (_TAG + varint_size(self.longest[1]))
            + self.longest[top]
        )

    def _scores(self, top: int) -> int:
        """A PromptLogprob's fields besides its own token's: logprob, rank and `top` alternatives (none
        at all for 0: the entry leaves the message unset)."""
        rank = _TAG + varint_size(len(self.own))  # a rank is at most the vocabulary's size
        return (_TAG + _FLOAT) + rank + (_field(self._alternatives(top)) if top else 0)

    def bound(
        self,
        prompt_token_ids: Sequence[int],
        is_token_ids: Sequence[bool],
        top: int,
        num_tokens: int = 1,
        top_of_tokens: int = 0,
    ) -> int:
        """The most bytes a reply takes whose delta holds an entry for each prompt position, with `top`
        alternatives each, and `num_tokens` sampled tokens with `top_of_tokens` alternatives each."""
        own, scores = self.own, self._scores(top)
        # Each entry framed by a prefix as long as the longest entry's.
        frame = _TAG + varint_size(self._max_own + scores)
        # At C speed (8,192 positions: 0.4 ms, 2.2 ms as a generator): it runs at every admission.
        tokens_own = sum(map(own.__getitem__, compress(prompt_token_ids, is_token_ids)))
        entries = tokens_own + len(prompt_token_ids) * (scores + frame)
        longest = self.longest[1]
        tokens = (
            _field(self._id * num_tokens)  # token_ids
            + _field(_TEXT_BYTES_PER_TOKEN_BYTE * longest * num_tokens)  # text
            + _field(_FLOAT * num_tokens)  # logprobs
            + num_tokens * _field(self._alternatives(top_of_tokens))  # top_logprobs
            + num_tokens * _field(longest)  # token_bytes
        )
        return _field(MAX_REQUEST_ID_BYTES) + _field(entries + tokens)

    def check(
        self,
        prompt_token_ids: Sequence[int],
        is_token_ids: Sequence[bool],
        top: int,
        max_new_tokens: int,
        top_of_tokens: int,
        max_bytes: int,
    ) -> None:
        """Raises InvalidArgument naming output.prompt_logprobs when the delta may not fit `max_bytes`."""
        num_tokens = min(max_new_tokens, MAX_TOKENS_WITH_SCORES)
        bound = self.bound(prompt_token_ids, is_token_ids, top, num_tokens, top_of_tokens)
        if bound > max_bytes:
            num_positions = len(prompt_token_ids)
            raise InvalidArgument(
                "output.prompt_logprobs",
                f"{num_positions} prompt positions with {top} alternatives each may take up to {bound} "
                f"bytes in one reply, over this decoder's --max-message-bytes {max_bytes}; ask for fewer "
                "alternatives or a shorter prompt, or raise --max-message-bytes (the decoder's and its "
                "caller's)",
            )
