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
