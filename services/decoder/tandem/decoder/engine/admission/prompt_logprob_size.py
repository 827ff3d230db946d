"""Whether a request's prompt-logprob delta can fit in one message of its front's (--max-message-bytes).

NOTE: why at admission. A request's prompt logprobs go out as one delta, built only once its whole
prompt has run; one over gRPC's message limit failed there, after the prefill (8.8 s of it in review),
with grpc's own "Sent message larger than max" (RESOURCE_EXHAUSTED). Its size is known closely enough
before any position runs: each position's entry holds its token and the n alternatives, each an ID,
a logprob and the token's own bytes (`outputs/token_bytes.py`), none longer than the table's longest.
So a request whose bound is over the limit is refused INVALID_ARGUMENT, naming output.prompt_logprobs,
and nothing runs; one whose bound fits is sent whole.

The bound is the delta's proto3 wire size (tandem.v1 GenerateResponse) at its worst: every ID 5 bytes,
every token its longest, a position's n alternatives the n longest tokens (they are n distinct tokens),
every length prefix as long as the largest length it can hold, the longest request ID, and the tokens
sampled with it (`MAX_TOKENS_WITH_SCORES`). Only the last is reasoned from outside this module; the
test builds deltas of the longest tokens and checks the bound against their serialized sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.client.errors import InvalidArgument
from tandem.common.wire_limits import MAX_REQUEST_ID_BYTES
from tandem.decoder.config import MAX_SPECULATIVE_TOKENS
from tandem.decoder.engine.outputs.backpressure import MAX_STREAM_INTERVAL, MAX_UNREAD_TOKENS
from tandem.decoder.engine.outputs.token_bytes import TokenBytes
from tandem.decoder.engine.params import MAX_TOP_LOGPROBS

_TAG = 1  # every field number here is below 16: a one-byte tag
_ID = 5  # a uint32 as a varint, at most
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


@dataclass(frozen=True)
class PromptLogprobSize:
    """Upper bounds of a prompt-logprob delta's wire size from one tokenizer's token bytes."""

    # longest[k] = bytes of the k longest tokens together, k = 0 .. MAX_TOP_LOGPROBS + 1
    longest: tuple[int, ...]

    @staticmethod
    def of(token_bytes: TokenBytes) -> PromptLogprobSize:
        lengths = sorted((len(own) for own in token_bytes.table), reverse=True)[: MAX_TOP_LOGPROBS + 1]
        sums = [0]
        for length in lengths + [0] * (MAX_TOP_LOGPROBS + 1 - len(lengths)):
            sums.append(sums[-1] + length)
        return PromptLogprobSize(tuple(sums))

    def _alternatives(self, top: int) -> int:
        """A TopLogprobs of `top` tokens: their IDs and logprobs packed, and each one's bytes."""
        return (
            _field(_ID * top)
            + _field(_FLOAT * top)
            + top * (_TAG + varint_size(self.longest[1]))
            + self.longest[top]
        )

    def _entry(self, top: int) -> int:
        """A PromptLogprob: its token's ID, logprob and bytes, and `top` alternatives."""
        return (_TAG + _ID) + (_TAG + _FLOAT) + _field(self.longest[1]) + _field(self._alternatives(top))

    def bound(self, num_positions: int, top: int, num_tokens: int = 1, top_of_tokens: int = 0) -> int:
        """The most bytes a reply takes whose delta holds `num_positions` entries with `top` alternatives
        each and `num_tokens` sampled tokens with `top_of_tokens` alternatives each."""
        own = self.longest[1]
        tokens = (
            _field(_ID * num_tokens)  # token_ids
            + _field(_TEXT_BYTES_PER_TOKEN_BYTE * own * num_tokens)  # text
            + _field(_FLOAT * num_tokens)  # logprobs
            + num_tokens * _field(self._alternatives(top_of_tokens))  # top_logprobs
            + num_tokens * _field(own)  # token_bytes
        )
        delta = num_positions * _field(self._entry(top)) + tokens
        return _field(MAX_REQUEST_ID_BYTES) + _field(delta)

    def check(
        self, num_positions: int, top: int, max_new_tokens: int, top_of_tokens: int, max_bytes: int
    ) -> None:
        """Raises InvalidArgument naming output.prompt_logprobs when the delta may not fit `max_bytes`."""
        num_tokens = min(max_new_tokens, MAX_TOKENS_WITH_SCORES)
        bound = self.bound(num_positions, top, num_tokens, top_of_tokens)
        if bound > max_bytes:
            raise InvalidArgument(
                "output.prompt_logprobs",
                f"{num_positions} prompt positions with {top} alternatives each may take up to {bound} "
                f"bytes in one reply, over this decoder's --max-message-bytes {max_bytes}; ask for fewer "
                "alternatives or a shorter prompt, or raise --max-message-bytes (the decoder's and its "
                "caller's)",
            )
