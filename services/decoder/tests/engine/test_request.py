"""Request: a prompt of segments flattened to positions, plus its scheduling state."""

from __future__ import annotations

import pytest

from services.decoder.tests.engine.scheduling_helpers import digest, embedding
from tandem.client.errors import InvalidArgument
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.engine.request import (
    EmbeddingSegment,
    EmbeddingSpan,
    InvalidPromptError,
    Request,
    RequestStatus,
    TokenSegment,
)


def test_segments_flatten_to_positions_with_token_mask_spans_and_digests() -> None:
    rows = object()
    segment = EmbeddingSegment(rows=rows, num_rows=2, digests=[digest("a"), digest("b")])
    request = Request.from_segments("r", [TokenSegment([7, 8]), segment, TokenSegment([9])])

    assert request.prompt_token_ids == [7, 8, 0, 0, 9]
    assert request.is_token_ids == [True, True, False, False, True]
    assert request.embedding_spans == [EmbeddingSpan(start=2, end=4, rows=rows)]
    assert request.embedding_digests == {2: digest("a"), 3: digest("b")}


def test_token_only_prompt_has_no_embeddings() -> None:
    request = Request.from_segments("r", [TokenSegment([1, 2, 3])])
    assert request.embedding_spans == []
    assert request.embedding_digests == {}


def test_params_and_arrival_time_are_kept() -> None:
    sampling = SamplingParams(temperature=0.0)
    stopping = StoppingParams(max_new_tokens=3)
    request = Request.from_segments("r", [TokenSegment([1])], sampling, stopping, arrival_time=12.5)
    assert (request.sampling, request.stopping, request.arrival_time) == (sampling, stopping, 12.5)


@pytest.mark.parametrize(
    "segments",
    [[], [TokenSegment([])], [TokenSegment([]), embedding([])]],
    ids=["none", "empty", "all-empty"],
)
def test_empty_prompt_is_rejected_naming_the_prompt(segments: list) -> None:
    with pytest.raises(ValueError, match="prompt") as info:
        Request.from_segments("r", segments)
    assert isinstance(info.value, InvalidArgument)
    assert info.value.field == "prompt"


def test_empty_segments_contribute_nothing() -> None:
    request = Request.from_segments("r", [embedding([]), TokenSegment([4])])
    assert request.prompt_token_ids == [4]
    assert request.embedding_spans == []


def test_digest_count_must_match_rows_and_the_error_names_the_segment() -> None:
    bad = EmbeddingSegment(rows=object(), num_rows=3, digests=[digest("a")])
    with pytest.raises(InvalidPromptError) as info:
        Request.from_segments("r", [TokenSegment([1]), bad])
    assert info.value.field == "prompt[1].embeddings.digests"


def test_direct_construction_checks_mask_length_and_digests() -> None:
    with pytest.raises(InvalidPromptError, match="is_token_ids"):
        Request("r", prompt_token_ids=[1, 2], is_token_ids=[True])
    with pytest.raises(InvalidPromptError, match="digest"):
        Request("r", prompt_token_ids=[0], is_token_ids=[False])


def test_outputs_extend_num_tokens() -> None:
    request = Request.from_segments("r", [TokenSegment([5, 6, 7])])
    request.output_token_ids += [1, 2]

    assert request.num_prompt_tokens == 3
    assert request.num_output_tokens == 2
    assert request.num_tokens == 5


def test_new_request_is_waiting_with_no_blocks() -> None:
    request = Request.from_segments("r", [TokenSegment([1])])
    assert request.status is RequestStatus.WAITING
    assert (request.num_computed_tokens, request.num_cached_tokens, request.block_ids) == (0, 0, [])


def test_only_finished_statuses_are_finished() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    }


def test_requests_with_equal_prompts_are_distinct() -> None:
    a = Request.from_segments("r", [TokenSegment([1])], arrival_time=0.0)
    b = Request.from_segments("r", [TokenSegment([1])], arrival_time=0.0)
    assert a != b
