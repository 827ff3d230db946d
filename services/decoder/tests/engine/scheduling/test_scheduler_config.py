"""SchedulerConfig: a configuration the scheduler could not honour is refused when built."""

from __future__ import annotations

import pytest

from tandem.decoder.engine.scheduling.scheduler_config import SchedulerConfig


def test_prefill_buckets_must_be_increasing_positive_sizes() -> None:
    for buckets in [(), (16, 4), (4, 4), (0, 4)]:
        with pytest.raises(ValueError, match="prefill_buckets must be increasing sizes >= 1"):
            SchedulerConfig(prefill_buckets=buckets)


def test_the_threshold_cannot_be_set_where_a_requests_chunks_must_not_depend_on_its_neighbours() -> None:
    # The batch-invariant mode's scheduling (max_tokens_per_request): a cap that only decodes beside
    # a chunk set would make its chunks, and so its bits, differ alone and among neighbours.
    with pytest.raises(ValueError, match="long_prefill_token_threshold would make"):
        SchedulerConfig(max_tokens_per_request=6, long_prefill_token_threshold=4)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 1"):
        SchedulerConfig(long_prefill_token_threshold=0)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"max_num_seqs": 0}, "SchedulerConfig.max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "SchedulerConfig.max_num_batched_tokens must be >= 1, got 0"),
        ({"max_waiting": 0}, "SchedulerConfig.max_waiting must be >= 1, got 0"),
        ({"shared_step_seqs": 0}, "SchedulerConfig.shared_step_seqs must be >= 1, got 0"),
        ({"max_tokens_per_request": 0}, "SchedulerConfig.max_tokens_per_request must be >= 1, got 0"),
        # Every running request is one row at least: fewer rows than requests could never run them all.
        (
            {"max_num_seqs": 4, "max_num_rows": 3},
            "SchedulerConfig.max_num_rows must be >= max_num_seqs, got 3",
        ),
        (
            {"long_prefill_token_threshold": 0},
            "SchedulerConfig.long_prefill_token_threshold must be >= 1, got 0",
        ),
    ],
)
def test_a_bound_below_its_least_is_refused_naming_the_field_and_the_least(kwargs: dict, said: str) -> None:
    with pytest.raises(ValueError) as refused:
        SchedulerConfig(**kwargs)
    assert str(refused.value) == said


def test_each_bound_at_its_least_is_taken() -> None:
    config = SchedulerConfig(
        max_num_seqs=1,
        max_num_batched_tokens=1,
        max_waiting=1,
        shared_step_seqs=1,
        max_tokens_per_request=1,
        max_num_rows=1,  # max_num_seqs
        prefill_buckets=(1,),
    )
    assert (config.max_num_seqs, config.max_num_rows, config.prefill_buckets) == (1, 1, (1,))
    assert SchedulerConfig(max_num_seqs=4, max_num_rows=4).max_num_rows == 4
    assert SchedulerConfig(long_prefill_token_threshold=1).long_prefill_token_threshold == 1
