"""The XLA runner's start-up: what it holds on the device while it places the model and the KV cache."""

from __future__ import annotations

import pytest

from tandem.decoder.backends.xla import runtime
from tandem.decoder.backends.xla.sharding import ShardingPlan
from tandem.decoder.engine.step.xla_buckets import XlaBuckets
from tandem.decoder.engine.step.xla_runner import XlaRunner
from tandem.decoder.models.loader import LoadedModel


def test_the_kv_caches_are_marked_with_their_sharding_before_they_are_materialized(
    tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Materialized first, every device held the pool whole until it was resharded: a 1 GiB pool split
    over 2 of XLA's CPU devices peaked at 3.72 GB RSS, not the 1.98 GB of its shards (host_pool.py)."""
    order: list[str] = []
    monkeypatch.setattr(runtime, "sync", lambda: order.append("materialized"))
    monkeypatch.setattr(runtime, "wait", lambda: order.append("weights transferred"))
    sharding = ShardingPlan(1)
    monkeypatch.setattr(sharding, "shard_model", lambda model, kv_caches: order.append("marked"))
    buckets = XlaBuckets(decode_seqs=(1,), prefill_tokens=(16,), widths=(1,), block_size=16)
    XlaRunner(tiny_fp32.model, num_blocks=2, block_size=16, buckets=buckets, sharding=sharding)
    assert order == ["weights transferred", "marked", "materialized"]
