"""Static-shape padding: which bucket a step lands in, the block-table width included."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step import sizing
from tandem.decoder.engine.step.batch import HostBatch
from tandem.decoder.engine.step.static_shapes import (
    StaticShapes,
    pad_to_buckets,
    padded_sizes,
    padded_width,
    warmup_shapes,
    width_buckets,
)

BLOCK_SIZE = 4
STATIC = StaticShapes(token_buckets=(1, 2, 4, 8, 16), seq_buckets=(1, 2, 4), block_table_widths=(2, 8, 32))


def _host(query_lens: list[int], seq_lens: list[int]) -> HostBatch:
    """A step of real sequences; each sampling its last position, tables as long as their context."""
    host = HostBatch()
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        host.input_ids += [7] * query_len
        host.positions += list(range(seq_len - query_len, seq_len))
        host.slots += list(range(seq_len - query_len, seq_len))
        host.is_token_ids += [True] * query_len
        host.query_lens.append(query_len)
        host.seq_lens.append(seq_len)
        host.block_tables.append(tuple(range(1, -(-seq_len // BLOCK_SIZE) + 1)))
        host.logits_rows.append(len(host.input_ids) - 1)
    host.num_logits = len(host.logits_rows)
    return host


def test_default_widths_grow_fourfold_and_end_at_the_longest_context() -> None:
    assert width_buckets(512) == (1, 4, 16, 64, 256, 512)
    assert width_buckets(64) == (1, 4, 16, 64)
    assert width_buckets(1) == (1,)


def test_a_decode_step_pads_its_tables_to_the_narrowest_width_that_holds_its_longest_context() -> None:
    host = _host([1, 1], [3, 8])  # 1 and 2 blocks of 4
    pad_to_buckets(host, STATIC, BLOCK_SIZE)
    assert padded_width(STATIC, host, BLOCK_SIZE) == 2
    longer = _host([1, 1], [3, 9])  # 9 positions need 3 blocks
    pad_to_buckets(longer, STATIC, BLOCK_SIZE)
    assert padded_width(STATIC, longer, BLOCK_SIZE) == 8


def test_a_prefill_chunk_that_fills_its_buckets_exactly_and_samples_nothing_still_pads_logits() -> None:
    host = _host([16], [16])
    host.logits_rows, host.num_logits = [], 0  # mid-prompt: its last position is not the prompt's
    pad_to_buckets(host, STATIC, BLOCK_SIZE)
    assert len(host.query_lens) == 1 and len(host.input_ids) == 16  # no padding sequence needed
    assert len(host.logits_rows) == 1 and host.num_logits == 0


def test_a_step_with_any_prefill_keeps_the_widest_table() -> None:
    host = _host([1, 3], [3, 3])
    pad_to_buckets(host, STATIC, BLOCK_SIZE)
    assert padded_width(STATIC, host, BLOCK_SIZE) == 32


def test_warmup_covers_every_width_of_the_decode_buckets_and_the_widest_of_the_others() -> None:
    shapes = warmup_shapes(STATIC)
    assert len(shapes) == len(set(shapes))
    decode = {(t, s, w) for t, s, w in shapes if t == s}
    assert decode == {(s, s, w) for s in (1, 2, 4) for w in (2, 8, 32)}
    assert {w for t, s, w in shapes if t != s} == {32}
    # Every padded step lands on a warmed shape.
    for query_lens, seq_lens in (([1, 1, 1], [5, 9, 30]), ([2, 1], [2, 4]), ([5], [5])):
        host = _host(query_lens, seq_lens)
        pad_to_buckets(host, STATIC, BLOCK_SIZE)
        shape = (len(host.input_ids), len(host.query_lens), padded_width(STATIC, host, BLOCK_SIZE))
        assert shape in shapes


def test_block_table_buckets_must_hold_the_longest_allowed_context(tmp_path: Path) -> None:
    config = EngineConfig(model_dir=tmp_path, static_shapes=True, block_size=4, block_table_buckets=(2, 8))
    with pytest.raises(ConfigError, match=r"^block_table_buckets: the largest must hold .* \(16\), got 8$"):
        sizing.static_shapes(config, max_model_len=64)
    assert sizing.static_shapes(config, max_model_len=32).block_table_widths == (2, 8)
    with pytest.raises(ValueError, match="block_table_buckets must be strictly increasing"):
        EngineConfig(model_dir=tmp_path, static_shapes=True, block_table_buckets=(8, 2))


def test_buckets_too_small_or_past_what_a_step_holds_are_refused_naming_the_flag(tmp_path: Path) -> None:
    """--token-buckets 1,2 and --block-table-buckets 1 failed at load (exit 1) after the port listened;
    a bucket past every step is padding alone, warmed all the same."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=32, speculative_max_batch=1, block_size=16)
    cases = [
        (
            dict(token_buckets=(1, 2)),
            "token_buckets: the largest must hold --max-num-batched-tokens 32 plus ",
        ),
        (dict(block_table_buckets=(1,)), "block_table_buckets: the largest must hold the blocks of "),
        (dict(seq_buckets=(4, 10**6)), "seq_buckets must be at most 32 (the rows a decode step holds: "),
        (dict(token_buckets=(64, 10**8)), "token_buckets must be at most 64 (--max-num-batched-tokens 32 "),
        (dict(block_table_buckets=(4, 10**8)), "block_table_buckets must be at most 4 (the blocks of "),
        # A step of 4 sequences pads into a fifth: the engine failed every request, "5 exceeds the
        # largest bucket 4".
        (dict(seq_buckets=(1, 2, 4)), "seq_buckets: the largest must hold --max-num-seqs 4 and a padding "),
    ]
    for overrides, said in cases:
        config = EngineConfig(model_dir=tmp_path, static_shapes=True, **limits, **overrides)
        with pytest.raises(ConfigError) as refused:
            sizing.static_shapes(config, max_model_len=64)
        assert str(refused.value).startswith(said), str(refused.value)


@pytest.mark.parametrize("max_num_seqs", [1, 5, 64, 100])
def test_the_default_buckets_are_within_the_bounds(tmp_path: Path, max_num_seqs: int) -> None:
    config = EngineConfig(
        model_dir=tmp_path, static_shapes=True, max_num_seqs=max_num_seqs, speculative_max_batch=1
    )
    static = sizing.static_shapes(config, max_model_len=1000)
    assert static is not None and static.seq_buckets[-1] > max_num_seqs


def test_the_seq_buckets_need_reach_one_padding_sequence_past_max_num_seqs(tmp_path: Path) -> None:
    config = EngineConfig(model_dir=tmp_path, static_shapes=True, max_num_seqs=4, seq_buckets=(1, 2, 5))
    static = sizing.static_shapes(config, max_model_len=64)
    assert static is not None and padded_sizes(static, 4, 7) == (5, 8)  # 7 positions: 1 in a fifth


def test_block_table_buckets_may_reach_the_configured_context_past_the_pools_cap(tmp_path: Path) -> None:
    """--max-model-len 80 --block-table-buckets 5 ran, until a 4-block pool (48 positions a sequence)
    refused it naming "max_model_len 48"; the refusals name the context the user gave."""
    config = EngineConfig(
        model_dir=tmp_path, static_shapes=True, max_model_len=80, block_size=16, block_table_buckets=(5,)
    )
    static = sizing.static_shapes(config, max_model_len=48, configured_len=80)
    assert static is not None and static.block_table_widths == (5,)
    wider = dataclasses.replace(config, block_table_buckets=(6,))
    with pytest.raises(ConfigError) as refused:
        sizing.static_shapes(wider, max_model_len=48, configured_len=80)
    assert str(refused.value) == (
        "block_table_buckets must be at most 5 (the blocks of --max-model-len 80 at --block-size 16), got 6"
    )
    narrower = dataclasses.replace(config, block_table_buckets=(2,))
    with pytest.raises(ConfigError) as refused:
        sizing.static_shapes(narrower, max_model_len=48, configured_len=80)
    assert str(refused.value) == (
        "block_table_buckets: the largest must hold the blocks of the 48 positions the KV pool holds for "
        "one sequence (below --max-model-len 80) at --block-size 16 (3), got 2"
    )
