"""The XLA backend's buckets: derived from the engine's limits, few, and every reachable step covered."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
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


def test_buckets_too_small_for_the_limits_are_refused_naming_the_flag_and_the_limit() -> None:
    cases = [
        (
            dict(max_num_seqs=8, seq_buckets=(1, 4)),
            "seq_buckets: the largest must hold --max-num-seqs (8), got 4",
        ),
        (
            dict(token_buckets=(64,)),
            "token_buckets: the largest must hold --max-num-batched-tokens (128), got 64",
        ),
        (dict(token_buckets=(1, 128)), "token_buckets must hold at least 2 positions each, got 1"),
        (  # no --token-buckets: the default ones end at the budget, the flag to change
            dict(max_num_seqs=1, max_num_batched_tokens=1),
            "max_num_batched_tokens must be at least 2 with --device neuron (a prefill chunk's graph "
            "holds 2 positions at least), got 1",
        ),
        (
            dict(max_num_seqs=8, block_table_buckets=(4, 64)),
            "block_table_buckets: the largest must hold the blocks of a 2,048-position context at "
            "--block-size 16 (128), got 64",
        ),
    ]
    for overrides, said in cases:
        with pytest.raises(ConfigError) as refused:
            XlaBuckets.from_config(_config(**{"max_num_batched_tokens": 128, **overrides}), 2048, 1)
        assert str(refused.value) == said


def test_buckets_past_what_a_step_holds_are_refused_naming_the_flag_and_the_limit() -> None:
    """--seq-buckets 4,1000000 beside --max-num-seqs 4 asked for 32.9 GB at warmup, naming no flag."""
    config = dict(max_num_seqs=4, max_num_batched_tokens=30, speculative_max_batch=2)
    cases = [
        (dict(seq_buckets=(4, 1_000_000)), "seq_buckets must be at most 34 (the rows a decode step holds"),
        (dict(token_buckets=(32, 10**8)), "token_buckets must be at most 32 (the positions of a prefill"),
        (dict(block_table_buckets=(4, 10**8)), "block_table_buckets must be at most 4 (the blocks of"),
    ]
    for overrides, said in cases:
        with pytest.raises(ConfigError) as refused:
            XlaBuckets.from_config(_config(**config, **overrides), 64, 4)  # 30 positions: 32 on 4 devices
        assert str(refused.value).startswith(said), str(refused.value)
    reaching = _config(**config, seq_buckets=(4, 34), token_buckets=(16, 32), block_table_buckets=(4,))
    assert XlaBuckets.from_config(reaching, 64, 4).decode_seqs == (4, 34)


@pytest.mark.parametrize("max_num_seqs", [1, 5, 8, 100])
@pytest.mark.parametrize("num_devices", [1, 3])
def test_the_default_buckets_reach_what_a_step_holds_and_no_further(
    max_num_seqs: int, num_devices: int
) -> None:
    config = _config(max_num_seqs=max_num_seqs, max_num_batched_tokens=100, speculative_max_batch=1)
    buckets = XlaBuckets.from_config(config, 1000, num_devices)
    assert buckets.decode_seqs[-1] >= max_num_seqs
    assert buckets.prefill_tokens[-1] == -(-100 // num_devices) * num_devices
    assert buckets.widths[-1] == -(-1000 // 16)


def test_fourfold_steps_end_at_the_limit() -> None:
    assert fourfold(16, 128) == (16, 64, 128)
    assert fourfold(16, 64) == (16, 64)
    assert fourfold(4, 2) == (2,)
