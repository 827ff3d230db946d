"""The engine allocates its KV pool before the scheduler's block table: the table costs a Python object
per block, so a pool that cannot be allocated is refused (one line naming the flag that sized it)
before a table of it is built, however many blocks it asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.front import engine as engine_module
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models import kv_pool
from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.memory_limit import MemoryLimit


def test_a_pool_the_host_cannot_hold_is_refused_before_its_block_table_is_built(
    tiny_fp32: LoadedModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []

    class CountedBlockManager(engine_module.BlockManager):
        def __init__(self, num_blocks: int, *args: object) -> None:
            built.append(num_blocks)
            super().__init__(num_blocks, *args)

    monkeypatch.setattr(engine_module, "BlockManager", CountedBlockManager)
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(1 << 20, None))
    config = EngineConfig(model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=1 << 20)
    with pytest.raises(ConfigError) as refused:
        Engine(config, loaded=tiny_fp32)
    assert refused.value.field == "num_kv_blocks"
    assert (
        "bytes on this rank) could not be allocated (more than the 1,048,576 bytes of memory of this host)"
        in (str(refused.value))
    )
    assert built == []
