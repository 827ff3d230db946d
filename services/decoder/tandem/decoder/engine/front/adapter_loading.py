"""LoRA adapters loaded while the engine serves: read off the engine thread, installed on it.

NOTE: two halves. Reading an adapter (its files opened and checked against the model: peft_adapter.py)
runs on a thread of its own, where a slow disk or a large adapter holds up no step. Installing it runs
on the engine thread between steps, under the core's lock (core.between_steps): a free slot gets the
weights, then every other rank its shard, and only then is the name published, so no request can
name a slot whose weights are not yet written everywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from tandem.common.model_name import echo
from tandem.decoder.engine.front.loop import EngineThread
from tandem.decoder.engine.front.request_builders import init_builder_thread
from tandem.decoder.engine.scheduling.adapters import Adapter
from tandem.decoder.engine.step.core import EngineCore, EngineFault
from tandem.decoder.engine.step.runner import StepFeed
from tandem.decoder.models.adapter_root import AdapterRoot, start_up_shown
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.peft_adapter import FoundAdapter, LoraAdapter, read_adapter

log = logging.getLogger(__name__)


class AdapterLoader:
    """Loads adapters into one engine's LoRA slots; the engine's `load_adapter` and --lora use it."""

    def __init__(
        self,
        core: EngineCore,
        lora: LoraTable | None,  # None: LoRA is off, and every load is refused by the core's checks
        model_config: ModelConfig,
        peers: StepFeed | None,  # rank 0 of several: the other ranks, which install each adapter too
        thread: EngineThread,
    ) -> None:
        self._core = core
        self._lora = lora
        self._model_config = model_config
        self._peers = peers
        self._thread = thread
        self._reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-adapters", initializer=init_builder_thread
        )

    def load_at_start(self, loras: Sequence[tuple[str, Path]], adapter_root: AdapterRoot | None) -> None:
        """--lora NAME=PATH, each into its slot before serving (the engine thread not yet stepping)."""
        for name, path in loras:
            adapter = self._reader.submit(self._read, name, path).result()
            shown = start_up_shown(path) if adapter_root is None else adapter_root.shown(path)
            installing = self._core.between_steps(partial(self._install, name, shown, adapter))
            self._thread.run(self._core.run_between_steps)
            installing.result()

    async def load(
        self,
        name: str,
        path: str | Path,
        shown: str | None = None,
        found: FoundAdapter | None = None,
    ) -> Adapter:
        """Engine.load_adapter's work, once the engine is known to run (its docstring says the rest)."""
        shown = str(path) if shown is None else shown
        reading = self._reader.submit(self._read, name, path, shown, found)
        adapter = await asyncio.wrap_future(reading)
        installing = self._core.between_steps(partial(self._install, name, shown, adapter))
        self._thread.wake()
        return await asyncio.wrap_future(installing)

    def shutdown(self) -> None:
        """Stop the reader without waiting; a read not yet started is cancelled."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _read(
        self,
        name: str,
        path: str | Path,
        shown: str | None = None,
        found: FoundAdapter | None = None,
    ) -> LoraAdapter:
        self._core.check_can_load(name)  # the cheap refusals before the files are read; ends nothing
        assert self._lora is not None
        return read_adapter(path, self._model_config, self._lora.max_rank, shown, found)

    def _install(self, name: str, shown: str, adapter: LoraAdapter) -> Adapter:
        """On the engine thread between steps, under the core's lock: a free slot gets the weights,
        then the name is published (a request can name it from then on)."""
        assert self._lora is not None and self._core.adapters is not None
        slots = self._core.adapters
        slots.check_new(name)  # again: another load of the name or slot may have won the race since
        slot = self._core.take_slot()  # the files read and checked: only now may paused streams end for it
        start = time.perf_counter()
        self._lora.write(slot, adapter)
        self._core.runner.slots_written()
        if self._peers is not None:  # every rank writes its shard before a step can name the slot
            try:
                self._peers.install_adapter(slot, adapter)
            except Exception as error:  # they would run the slot with other weights from now on
                raise EngineFault(f"the other ranks missed adapter {echo(name)}: {error}") from error
        loaded = slots.add(name, shown, adapter.rank, adapter.targets, slot)
        log.info(
            "adapter %s (rank %d, %s) in slot %d: %.1f ms to write",
            name,
            adapter.rank,
            "/".join(adapter.targets),
            slot,
            1000 * (time.perf_counter() - start),
        )
        return loaded
