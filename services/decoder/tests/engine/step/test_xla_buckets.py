"""The XLA backend's buckets: derived from the engine's limits, few, and every reachable step covered."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step.xla_buckets import Bucket, XlaBuckets, fourfold


def _config(**overrides) -> EngineConfig:
    settings = dict(model_dir=Path("."), device="neuron", static_shapes=True, compile=True)
    settings.update(overrides)
    return EngineConfig(**settings)


def test_the_neuron_defaults_give_a_few_dozen_graphs() -> None:
    buckets = XlaBuckets.from_config(_config(max_num_seqs=8, max_num_batched_tokens=128), 2048, 1)
    assert buckets.decode_seqs == (1, 2, 4, 8)
    assert buckets.prefill_tokens == (16, 64, 128)
    assert buckets.widths == (4, 16, 64, 128)  # 2,048 positions in blocks of 16
    assert len(buckets.all()) == 16 + 4 + 4 + 3


def test_a_prefill_bucket_pairs_only_with_the_widths_its_chunks_can_have() -> None:
    # A chunk padded to 128 positions has more than 64 (else it would pad to 64): it spans > 4 blocks.
    buckets = XlaBuckets.from_config(_config(max_num_seqs=8, max_num_batched_tokens=128), 2048, 1)
    widths_of_128 = [b.width for b in buckets.all() if not b.is_decode and b.num_tokens == 128]
    assert widths_of_128 == [16, 64, 128]
    for num_tokens in range(65, 129):  # every chunk length that pads to 128, at every context length
        for seq_len in range(num_tokens, 2049, 37):
            assert buckets.prefill(num_tokens, seq_len) in buckets.all()


def test_every_step_the_scheduler_can_make_has_a_bucket() -> None:
    buckets = XlaBuckets.from_config(_config(max_num_seqs=8, max_num_batched_tokens=128), 2048, 1)
    every = set(buckets.all())
    for rows in range(1, 9):
        for seq_len in (1, 64, 65, 1000, 2048):
            assert buckets.decode(rows, seq_len) in every
    for num_tokens in range(1, 129):
        assert buckets.prefill(num_tokens, num_tokens) in every
    assert buckets.decode(3, 100) == Bucket(4, 4, 16, True)


def test_prefill_buckets_split_evenly_over_the_devices() -> None:
    buckets = XlaBuckets.from_config(
        _config(max_num_batched_tokens=128, token_buckets=(10, 30, 128), num_devices=4), 2048, 4
    )
    assert buckets.prefill_tokens == (12, 32, 128)


def test_buckets_too_small_for_the_limits_are_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=r"max_num_seqs \(8\)"):
        XlaBuckets.from_config(_config(max_num_seqs=8, seq_buckets=(1, 4)), 2048, 1)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(128\)"):
        XlaBuckets.from_config(_config(max_num_batched_tokens=128, token_buckets=(64,)), 2048, 1)
    with pytest.raises(ValueError, match="max_model_len / block_size = 128 blocks"):
        XlaBuckets.from_config(_config(max_num_seqs=8, block_table_buckets=(4, 64)), 2048, 1)


def test_fourfold_steps_end_at_the_limit() -> None:
    assert fourfold(16, 128) == (16, 64, 128)
    assert fourfold(16, 64) == (16, 64)
    assert fourfold(4, 2) == (2,)
