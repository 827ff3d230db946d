"""PromptLogprobSize: a bound on a prompt-logprob delta's wire size that its real serialized size never
passes, with the longest tokens everywhere and with embedding rows among them; exact for the prompt's
own tokens, so a prompt of short tokens is bounded by them rather than by the longest; and a refusal
over --max-message-bytes naming the field."""

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


_VOCAB = len(_TABLE.table)


def _delta(prompt: list[int | None], top_ids: tuple[int, ...], num_tokens: int, top_of_tokens: int) -> Delta:
    """A delta scoring `prompt` (None: an embedding row), `top_ids` the alternatives at every position,
    each rank the vocabulary's size (its longest varint); the sampled tokens the longest, text of 3
    bytes a token byte, the longest request ID."""
    longest = _LONGEST_IDS[0]
    own = len(_TABLE.table[longest])
    alternatives = tuple(-1.0 - k for k in range(len(top_ids)))
    entries = tuple(
        PromptLogprob(t, None, (), ()) if p == 0 else PromptLogprob(t, -1.5, top_ids, alternatives, _VOCAB)
        for p, t in enumerate(prompt)
    )
    return Delta(
        "r" * MAX_REQUEST_ID_BYTES,
        (longest,) * num_tokens,
        "\ufffd" * (own * num_tokens),
        (-0.5,) * num_tokens,
        tuple(TopLogprobs(_LONGEST_IDS[:top_of_tokens], (-1.0,) * top_of_tokens) for _ in range(num_tokens)),
        prompt_logprobs=entries,
    )


def _bound(size: PromptLogprobSize, prompt: list[int | None], top: int, *tokens: int) -> int:
    return size.bound([t or 0 for t in prompt], [t is not None for t in prompt], top, *tokens)


def _real(delta: Delta) -> int:
    return event_to_pb(delta, _TABLE).ByteSize()


@pytest.mark.parametrize(
    ("num_positions", "top", "num_tokens", "top_of_tokens"),
    [
        (1, 0, 1, 0),
        (7, 1, 1, 0),
        (300, 0, 1, 0),
        (300, 20, 1, 0),
        (40, 20, MAX_TOKENS_WITH_SCORES, 20),
        (200, 5, 3, 2),
    ],
)
def test_the_bound_is_never_below_a_delta_of_the_longest_tokens_and_close_to_it(
    num_positions: int, top: int, num_tokens: int, top_of_tokens: int
) -> None:
    size = PromptLogprobSize.of(_TABLE, _VOCAB)
    prompt: list[int | None] = [_LONGEST_IDS[0]] * num_positions
    real = _real(_delta(prompt, _LONGEST_IDS[:top], num_tokens, top_of_tokens))
    assert real <= _bound(size, prompt, top, num_tokens, top_of_tokens) < 1.05 * real + 100


def test_the_bound_holds_for_a_prompt_of_embedding_rows_and_tokens_whose_alternatives_are_the_longest() -> (
    None
):
    size = PromptLogprobSize.of(_TABLE, _VOCAB)
    prompt: list[int | None] = [*_LONGEST_IDS[:5], None, None, *_LONGEST_IDS[5:], None]
    real = _real(_delta(prompt, _LONGEST_IDS[:20], 1, 0))
    assert real <= _bound(size, prompt, 20) < 1.05 * real + 100


def _typical(num_positions: int, seed: int) -> list[int | None]:
    """Short tokens (1-40 bytes, IDs past 65,535 too), as a prompt of text has."""
    rng = random.Random(seed)
    return [rng.randrange(_VOCAB - 21) for _ in range(num_positions)]


@pytest.mark.parametrize("top", [0, 5, 20])
def test_a_prompt_of_short_tokens_is_bounded_by_its_own_bytes_not_the_longest_tokens(top: int) -> None:
    size = PromptLogprobSize.of(_TABLE, _VOCAB)
    prompt = _typical(300, seed=top)
    own_bytes = sum(len(_TABLE.table[t]) for t in prompt if t is not None)
    longest = [_LONGEST_IDS[0]] * len(prompt)
    # The alternatives may still be the longest; the prompt's own tokens are what they are.
    real = _real(_delta(prompt, _LONGEST_IDS[:top], 1, 0))
    bound = _bound(size, prompt, top)
    assert real <= bound <= _bound(size, longest, top) - (201 * len(prompt) - own_bytes)
    if top == 0:  # nothing unknown but the logprobs' values: the bound is the size, nearly
        assert bound < real + 10 * 300


def test_the_longest_sums_are_of_the_longest_tokens_and_a_short_table_pads_with_none() -> None:
    size = PromptLogprobSize.of(_TABLE, _VOCAB)
    assert size.longest[:3] == (0, 201, 201 + 193)
    assert PromptLogprobSize.of(TokenBytes((b"ab", b"c")), 2).longest == (0, 2, 3) + (3,) * 19


def test_an_id_past_the_tokenizers_entries_counts_as_spelled_by_no_bytes() -> None:
    # A model's vocabulary padded past its tokenizer's entries: the padding's IDs have no bytes.
    size = PromptLogprobSize.of(TokenBytes((b"ab", b"c")), 200)
    assert size.own[:2] == (1 + 1 + 1 + 1 + 2, 1 + 1 + 1 + 1 + 1) and size.own[199] == 1 + 2 + 1 + 1


def test_varint_sizes() -> None:
    assert [varint_size(v) for v in (0, 127, 128, 16_383, 16_384, 2**32 - 1)] == [1, 1, 2, 2, 3, 5]


def test_a_delta_that_may_not_fit_is_refused_naming_the_field_and_the_flag() -> None:
    size = PromptLogprobSize.of(_TABLE, _VOCAB)
    prompt = _typical(301, seed=1)
    limit = _bound(size, prompt[:300], 20)  # max_new_tokens 1, no alternatives for the sampled token
    size.check(prompt[:300], [True] * 300, 20, max_new_tokens=1, top_of_tokens=0, max_bytes=limit)
    with pytest.raises(InvalidArgument, match=r"--max-message-bytes") as refused:
        size.check(prompt, [True] * 301, 20, max_new_tokens=1, top_of_tokens=0, max_bytes=limit)
    assert refused.value.field == "output.prompt_logprobs"


def test_the_sampled_tokens_counted_are_at_most_max_new_tokens() -> None:
    size = PromptLogprobSize.of(_TABLE, _VOCAB)
    prompt, is_token_ids = [5] * 10, [True] * 10
    capped = size.bound(prompt, is_token_ids, 2, MAX_TOKENS_WITH_SCORES, 20)
    size.check(prompt, is_token_ids, 2, max_new_tokens=10**6, top_of_tokens=20, max_bytes=capped)
    with pytest.raises(InvalidArgument):
        size.check(prompt, is_token_ids, 2, max_new_tokens=10**6, top_of_tokens=20, max_bytes=capped - 1)


def test_a_full_smollm2_sized_context_fits_the_default_64_mib() -> None:
    # SmolLM2's longest entry is 81 bytes and its 20 longest 1,250 (measured); its context is 8,192,
    # here all of the longest entry (an ID of 3 bytes).
    smollm2 = PromptLogprobSize((0, 81) + tuple(81 + 58 * k for k in range(1, 21)), (4 + 2 + 81,) * 49_152)
    prompt = [49_151] * 8192
    assert smollm2.bound(prompt, [True] * 8192, 20, MAX_TOKENS_WITH_SCORES, 20) < 64 * 1024 * 1024


def test_the_bound_matches_the_wire_format_of_an_empty_reply() -> None:
    # A reply of no entries and no tokens is still framed: request ID and delta.
    assert decoder_pb2.GenerateResponse(request_id="r" * MAX_REQUEST_ID_BYTES).ByteSize() <= (
        PromptLogprobSize.of(_TABLE, _VOCAB).bound([], [], 0, 0, 0)
    )
