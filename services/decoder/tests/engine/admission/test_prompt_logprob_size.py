"""PromptLogprobSize: a bound on a prompt-logprob delta's wire size that its real serialized size, with
the longest tokens everywhere, never passes; and a refusal over --max-message-bytes naming the field."""

from __future__ import annotations

import random

import pytest

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.common.wire_limits import MAX_REQUEST_ID_BYTES
from tandem.decoder.api.protocol import event_to_pb
from tandem.decoder.engine.admission.prompt_logprob_size import (
    MAX_TOKENS_WITH_SCORES,
    PromptLogprobSize,
    varint_size,
)
from tandem.decoder.engine.outputs.outputs import Delta, TopLogprobs
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprob
from tandem.decoder.engine.outputs.token_bytes import TokenBytes

# 70,000 entries of 1-40 bytes; the 21 longest (41-201 bytes, "é"s and a lone byte among them) sit
# past ID 65,535, where an ID's varint takes 3 bytes.
_RNG = random.Random(0)
_SHORT = [bytes(_RNG.randrange(97, 123) for _ in range(_RNG.randrange(1, 41))) for _ in range(69_979)]
_LONG = ["é".encode() * (20 + 4 * k) + b"\xc3" for k in range(21)]  # 41 .. 201 bytes
_TABLE = TokenBytes(tuple(_SHORT + _LONG))
_LONGEST_IDS = tuple(sorted(range(len(_TABLE.table)), key=lambda i: -len(_TABLE.table[i]))[:21])


def _worst_delta(num_positions: int, top: int, num_tokens: int, top_of_tokens: int) -> Delta:
    """A delta as large as these counts allow: the longest tokens everywhere, text of 3 bytes a token
    byte, the longest request ID."""
    longest = _LONGEST_IDS[0]
    own = len(_TABLE.table[longest])
    entries = tuple(
        PromptLogprob(longest, -1.5, _LONGEST_IDS[:top], tuple(-1.0 - k for k in range(top)))
        for _ in range(num_positions)
    )
    return Delta(
        "r" * MAX_REQUEST_ID_BYTES,
        (longest,) * num_tokens,
        "\ufffd" * (own * num_tokens),
        (-0.5,) * num_tokens,
        tuple(TopLogprobs(_LONGEST_IDS[:top_of_tokens], (-1.0,) * top_of_tokens) for _ in range(num_tokens)),
        prompt_logprobs=entries,
    )


@pytest.mark.parametrize(
    ("num_positions", "top", "num_tokens", "top_of_tokens"),
    [(1, 0, 1, 0), (7, 1, 1, 0), (300, 20, 1, 0), (40, 20, MAX_TOKENS_WITH_SCORES, 20), (200, 5, 3, 2)],
)
def test_the_bound_is_never_below_a_delta_of_the_longest_tokens_and_close_to_it(
    num_positions: int, top: int, num_tokens: int, top_of_tokens: int
) -> None:
    size = PromptLogprobSize.of(_TABLE)
    real = event_to_pb(_worst_delta(num_positions, top, num_tokens, top_of_tokens), _TABLE).ByteSize()
    bound = size.bound(num_positions, top, num_tokens, top_of_tokens)
    assert real <= bound < 1.1 * real + 100


def test_the_longest_sums_are_of_the_longest_tokens_and_a_short_table_pads_with_none() -> None:
    size = PromptLogprobSize.of(_TABLE)
    assert size.longest[:3] == (0, 201, 201 + 193)
    assert PromptLogprobSize.of(TokenBytes((b"ab", b"c"))).longest == (0, 2, 3) + (3,) * 19


def test_varint_sizes() -> None:
    assert [varint_size(v) for v in (0, 127, 128, 16_383, 16_384, 2**32 - 1)] == [1, 1, 2, 2, 3, 5]


def test_a_delta_that_may_not_fit_is_refused_naming_the_field_and_the_flag() -> None:
    size = PromptLogprobSize.of(_TABLE)
    limit = size.bound(300, 20)  # max_new_tokens 1, no alternatives for the sampled token
    size.check(300, 20, max_new_tokens=1, top_of_tokens=0, max_bytes=limit)
    with pytest.raises(InvalidArgument, match=r"--max-message-bytes") as refused:
        size.check(301, 20, max_new_tokens=1, top_of_tokens=0, max_bytes=limit)
    assert refused.value.field == "output.prompt_logprobs"


def test_the_sampled_tokens_counted_are_at_most_max_new_tokens() -> None:
    size = PromptLogprobSize.of(_TABLE)
    capped = size.bound(10, 2, MAX_TOKENS_WITH_SCORES, 20)
    size.check(10, 2, max_new_tokens=10**6, top_of_tokens=20, max_bytes=capped)
    with pytest.raises(InvalidArgument):
        size.check(10, 2, max_new_tokens=10**6, top_of_tokens=20, max_bytes=capped - 1)


def test_a_full_smollm2_sized_context_fits_the_default_64_mib() -> None:
    # SmolLM2's longest entry is 81 bytes and its 20 longest 1,250 (measured); its context is 8,192.
    smollm2 = PromptLogprobSize((0, 81) + tuple(81 + 58 * k for k in range(1, 21)))
    assert smollm2.bound(8192, 20, MAX_TOKENS_WITH_SCORES, 20) < 64 * 1024 * 1024


def test_the_bound_matches_the_wire_format_of_an_empty_reply() -> None:
    # A reply of no entries and no tokens is still framed: request ID and delta.
    assert decoder_pb2.GenerateResponse(request_id="r" * MAX_REQUEST_ID_BYTES).ByteSize() <= (
        PromptLogprobSize.of(_TABLE).bound(0, 0, 0, 0)
    )
