"""scripts/device_bench.py's engines: what it asks of the decoder is accepted for any --sizes."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step import sizing

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_bench.py"


@functools.cache
def _device_bench() -> ModuleType:  # a script, not a package: loaded from its file, once
    spec = importlib.util.spec_from_file_location("device_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sizes", [[1, 8, 32, 128], [1, 8], [32], [8, 1]])
def test_graphs_modes_seq_buckets_follow_the_sizes(tmp_path: Path, sizes: list[int]) -> None:
    """A fixed (1, 8, 32, 128, 129) was refused for --sizes 1,8: past what 8 sequences need."""
    bench = _device_bench()
    buckets = bench.seq_buckets(sizes)
    assert set(sizes) < set(buckets) and buckets[-1] == max(sizes) + 1  # the padding sequence's
    config = EngineConfig(
        model_dir=tmp_path,
        static_shapes=True,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=4096,
        seq_buckets=buckets,
        block_table_buckets=(16,),
    )
    assert sizing.static_shapes(config, bench.MAX_MODEL_LEN) is not None
