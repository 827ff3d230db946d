"""The rules on one piece of prompt: each names the piece's field path and the limit it broke."""

from __future__ import annotations

import pytest
import torch

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common.torch_part.prompt_parts import (
    EmbeddingPrompt,
    EncoderPrompt,
    TextPrompt,
    check_part,
    check_token_id,
    check_token_ids,
    how_counted,
    num_positions_at_least,
)

HIDDEN = 8


def _error(part, path: str = "prompt[2]", accepts_embeddings: bool = True) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        check_part(part, path, HIDDEN, accepts_embeddings)
    return info.value


def test_empty_text_and_empty_token_ids_are_refused_at_their_field() -> None:
    assert _error(TextPrompt("")).field == "prompt[2].text"
    assert _error([]).field == "prompt[2].token_ids.ids"
    assert _error(tensor_pb2.TokenIds().ids).field == "prompt[2].token_ids.ids"  # the proto's field as is


def test_a_top_level_piece_has_no_path_prefix() -> None:
    assert _error(TextPrompt(""), path="").field == "text"
    assert _error([], path="").field == "token_ids.ids"


@pytest.mark.parametrize("shape", [(2, HIDDEN + 1), (0, HIDDEN), (HIDDEN,), (1, 2, HIDDEN)])
def test_embeddings_must_be_rows_of_the_hidden_size(shape: tuple[int, ...]) -> None:
    error = _error(EmbeddingPrompt(torch.zeros(shape)), path="chat.messages[0].content[1]")
    assert error.field == "chat.messages[0].content[1].embeddings.shape"
    assert error.description == f"expected [n >= 1, {HIDDEN}], got {list(shape)}"


def test_embeddings_a_server_does_not_accept_are_a_failed_precondition_before_their_shape() -> None:
    with pytest.raises(FailedPrecondition) as info:
        check_part(EmbeddingPrompt(torch.zeros(3)), "prompt[0]", HIDDEN, accepts_embeddings=False)
    assert info.value.field == "prompt[0].embeddings"


def test_well_formed_pieces_pass() -> None:
    for part in (TextPrompt("hi"), [1, 2], EmbeddingPrompt(torch.zeros(3, HIDDEN))):
        check_part(part, "prompt[0]", HIDDEN, accepts_embeddings=True)


def test_the_first_token_id_outside_the_vocabulary_is_named_with_its_index() -> None:
    check_token_ids([0, 9], "prompt[1].token_ids.ids", vocab_size=10)
    for ids, index, bad in (([1, 10, 11], 1, 10), ([3, -1], 1, -1), ([2**32 - 1], 0, 2**32 - 1)):
        with pytest.raises(InvalidArgument) as info:
            check_token_ids(ids, "prompt[1].token_ids.ids", vocab_size=10)
        assert info.value.field == f"prompt[1].token_ids.ids[{index}]"
        assert info.value.description == f"token id {bad} outside [0, 10)"


def test_one_token_id_is_checked_by_the_same_rule() -> None:
    with pytest.raises(InvalidArgument, match=r"token id 10 outside \[0, 10\)") as info:
        check_token_id(10, "sampling.logit_bias", vocab_size=10)
    assert info.value.field == "sampling.logit_bias"


def test_the_length_bound_counts_ids_and_rows_and_text_at_one_position_per_longest_token() -> None:
    parts = [[1, 2, 3], EmbeddingPrompt(torch.zeros(4, HIDDEN)), TextPrompt("a" * 11)]
    assert num_positions_at_least(parts, max_token_chars=5) == 3 + 4 + 3
    assert num_positions_at_least([], max_token_chars=5) == 0


def test_an_encoder_parts_input_counts_as_the_same_input_would_where_its_rows_are_one_per_position() -> None:
    # Counted at one, a text that could never fit was embedded, then refused naming the encoder's limit.
    text = EncoderPrompt("text", "a" * 11, counts_as_input=True)
    ids = EncoderPrompt("token_ids", [4, 5, 6, 7], counts_as_input=True)
    picture = EncoderPrompt("image", b"png", counts_as_input=True)
    assert num_positions_at_least([text, ids, picture], max_token_chars=5) == 3 + 4 + 1


def test_an_encoder_part_whose_rows_are_unknown_until_they_come_counts_at_one() -> None:
    # Pooled rows, or a projector's own tokenizer: one row for 2,000 IDs was refused at 2,000.
    parts = [EncoderPrompt("text", "a" * 11), EncoderPrompt("token_ids", [4] * 2000)]
    assert num_positions_at_least(parts, max_token_chars=5) == 2


def test_how_the_bound_counted_names_each_rule_that_applied_once() -> None:
    assert how_counted([[1, 2], TextPrompt("abc"), [3]], max_token_chars=5) == (
        "text takes one per 5 characters or fewer, a token ID takes one"
    )
    assert how_counted([EncoderPrompt("token_ids", [4], counts_as_input=True)], 5) == "a token ID takes one"
    assert how_counted([EmbeddingPrompt(torch.zeros(1, HIDDEN)), EncoderPrompt("text", "a")], 5) == (
        "a row takes one, an encoder part takes at least one"
    )
