"""The engine allocates its KV pool before the scheduler's block table: the table costs a Python object
per block, so a pool that cannot be allocated is refused (one line naming the flag that sized it)
before a table of it is built, however many blocks it asks for."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psutil
import pytest

from tandem.client.errors import ConfigError
from tandem.common.memory_limit import MemoryLimit
from tandem.decoder.backends.backend import resolve
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.front import core_assembly
from tandem.decoder.engine.front import engine as engine_module
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models import kv_pool
from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.peft_adapter import AdapterError


def test_a_pool_the_host_cannot_hold_is_refused_before_its_block_table_is_built(
    tiny_fp32: LoadedModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []

    class CountedBlockManager(core_assembly.BlockManager):
        def __init__(self, num_blocks: int, *args: object) -> None:
            built.append(num_blocks)
            super().__init__(num_blocks, *args)

    monkeypatch.setattr(core_assembly, "BlockManager", CountedBlockManager)
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
    # The count is on the table's path: a pool the host holds builds its table through it, once.
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(1 << 40, None))
    Engine(
        EngineConfig(model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=16), loaded=tiny_fp32
    ).shutdown()
    assert len(built) == 1


def _held() -> set[object]:
    """This process's live threads and child processes (the chat template's workers)."""
    threads = {thread for thread in threading.enumerate() if thread.is_alive()}
    return threads | {child.pid for child in psutil.Process().children()}


def _new_since(before: set[object]) -> set[object]:
    """What is held now and was not before, given up to 5 s to end: shutdown(wait=False) lets a
    builder's thread finish on its own (it read 'stopped' yet listed in one CI run), and an earlier
    test's engine may still be ending its own threads and workers while this one runs."""
    deadline = time.monotonic() + 5
    while (new := _held() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return new


def test_a_set_up_that_fails_after_the_load_raises_its_own_error_and_leaves_nothing_running(
    tiny_fp32: LoadedModel, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread was stopped only when the load failed: a refused pool (or anything later) left
    it waiting, and the chat template's workers running; a --lora adapter that could not be read called
    shutdown() on builder threads not made yet, so its own error came out as an AttributeError."""
    before = _held()
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(1 << 20, None))
    with pytest.raises(ConfigError, match="could not be allocated"):
        Engine(
            EngineConfig(model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=1 << 20), loaded=tiny_fp32
        )
    assert not _new_since(before)
    monkeypatch.undo()
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 8}))
    config = EngineConfig(
        model_dir=tiny_model_dir,
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        loras=(("big", tmp_path),),
    )
    with pytest.raises(AdapterError, match="more than the server.s --max-lora-rank 16"):
        Engine(config, loaded=tiny_fp32)
    assert not _new_since(before)


def _xla_pool_past_the_host(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> EngineConfig:
    """The tiny model's 2 KV heads do not divide over 4 devices: each holds the 1 GiB pool whole, 4 GiB
    on XLA's CPU device against a host of 3 GiB."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(3 * 2**30, None))
    return EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        device="neuron",
        static_shapes=True,
        compile=True,
        num_devices=4,
        kv_cache_bytes=2**30,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        block_size=16,
    )


def test_an_xla_pool_past_the_hosts_memory_is_refused_as_tandem_serve_decoder_refuses_it(
    tiny_fp32: LoadedModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine built in process skipped the check `tandem serve decoder --device neuron` makes before
    it listens (backends/xla/host_pool.py): on XLA's CPU device the pool was mapped past the host's
    memory. Refused before the XLA runner is imported (torch_xla need not be installed)."""
    config = _xla_pool_past_the_host(tiny_model_dir, monkeypatch)
    with pytest.raises(ConfigError) as refused:
        Engine(config, loaded=tiny_fp32, backend=resolve("neuron"))
    assert refused.value.field == "kv_cache_bytes"
    assert "more than the 3,221,225,472 bytes of memory of this host: XLA's CPU device holds the pool " in (
        refused.value.reason
    )


def test_an_xla_pool_past_the_hosts_memory_is_refused_from_config_json_before_the_load(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's size needs config.json's numbers alone: the refusal came after the XLA runtime's start
    and the load, 5-8 s of this tiny model (minutes of a large one); now in a millisecond."""
    config = _xla_pool_past_the_host(tiny_model_dir, monkeypatch)
    loads: list[object] = []
    monkeypatch.setattr(engine_module, "load_model", lambda *args: loads.append(args))
    with pytest.raises(ConfigError) as refused:
        Engine(config, backend=resolve("neuron"))
    assert refused.value.field == "kv_cache_bytes"
    assert loads == []
