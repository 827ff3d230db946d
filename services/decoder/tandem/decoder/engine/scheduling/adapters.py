"""Which LoRA adapter each slot holds, by name, and which slots wait for their last request. Pure Python.

NOTE: the life of a slot. Loading takes a free slot (RESOURCE_EXHAUSTED when none is) and, once its
weights are written, publishes the name. A request resolves its adapter's name to a slot when it is
admitted, under the engine core's lock, so it runs with the adapter it named or is refused
(NOT_FOUND). Unloading withdraws the name at once; a slot that live requests still use drains: they
finish on it, and it becomes free only when the last of them has ended (`release`), so a slot is
never rewritten under a request that reads it. Requests paused for their readers are the exception: a
reader may never read again, so a load that finds no free slot ends those that alone hold a draining
slot, and takes it (`EngineCore.take_slot`).

Each load gets a `cache_salt` of its own: the prefix cache keys blocks by it (kv_cache.py), so two
adapters, or two loads of one name, never share KV blocks.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection
from dataclasses import dataclass

from tandem.client import error_reasons as reasons
from tandem.client.errors import AlreadyExists, NotFound, ResourceExhausted
from tandem.common.model_name import check_adapter_name, echo


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter, as GetModelInfo and ListAdapters report it."""

    name: str
    path: str  # the directory it was read from, as reported: relative to --lora-root when inside it
    rank: int  # r
    targets: tuple[str, ...]  # the checkpoint modules it adapts (q_proj, ..., down_proj)
    slot: int  # in the LoRA table, [0, max_loras)
    cache_salt: bytes  # the prefix cache's namespace for its requests; unique per load


class AdapterSlots:
    """The names of the adapters in the table's `max_loras` slots. Not thread-safe: the engine core's
    lock guards it."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._by_name: dict[str, Adapter] = {}
        self._draining: set[int] = set()  # unloaded, still used by live requests
        self._loads = itertools.count(1)

    @property
    def adapters(self) -> list[Adapter]:
        """The loaded adapters, by name."""
        return [self._by_name[name] for name in sorted(self._by_name)]

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    @property
    def draining(self) -> frozenset[int]:
        """The unloaded adapters' slots that live requests still use."""
        return frozenset(self._draining)

    @property
    def has_free_slot(self) -> bool:
        return len(self._by_name) + len(self._draining) < self.max_loras

    def get(self, name: str) -> Adapter:
        """The adapter loaded under `name`; NotFound otherwise."""
        adapter = self._by_name.get(name)
        if adapter is None:
            loaded = ", ".join(repr(n) for n in sorted(self._by_name)) or "none"
            raise NotFound(f"adapter {echo(name)} is not loaded (loaded: {loaded})")
        return adapter

    def check_new(self, name: str) -> None:
        """Raises unless `name` is a valid name no adapter is loaded under."""
        check_adapter_name(name)
        if name in self._by_name:
            raise AlreadyExists(f"adapter {echo(name)} is loaded already: unload it first")

    def free_slot(self) -> int:
        """The lowest slot neither loaded nor draining; RESOURCE_EXHAUSTED when every one is."""
        taken = {a.slot for a in self._by_name.values()} | self._draining
        slot = next((s for s in range(self.max_loras) if s not in taken), None)
        if slot is None:
            # A draining slot is free once its running requests end (the core ends paused ones when a
            # load needs their slot), so a retry can succeed; with every slot loaded, only an
            # UnloadAdapter frees one, and a RetryInfo would invite retries that fail for ever.
            if self._draining:
                why = f"{len(self._draining)} of them draining: retry once their running requests end"
            else:
                why = "each holds a loaded adapter: unload one first"
            raise ResourceExhausted(
                f"all {self.max_loras} LoRA slots (--max-loras) are taken, {why}",
                retry_after_s=1.0 if self._draining else None,
                info=reasons.decoder_info(
                    reasons.LORA_SLOTS,
                    {reasons.MAX_LORAS: self.max_loras, reasons.DRAINING_SLOTS: len(self._draining)},
                ),
            )
        return slot

    def add(self, name: str, path: str, rank: int, targets: tuple[str, ...], slot: int) -> Adapter:
        """Publish an adapter whose weights are in `slot` (from free_slot, written since)."""
        self.check_new(name)
        salt = hashlib.blake2b(f"{next(self._loads)}\0{name}".encode(), digest_size=16).digest()
        adapter = Adapter(name, path, rank, targets, slot, salt)
        self._by_name[name] = adapter
        return adapter

    def remove(self, name: str, used_slots: Collection[int]) -> Adapter:
        """Withdraw `name` (NotFound if not loaded); its slot drains while `used_slots` holds it."""
        adapter = self.get(name)
        del self._by_name[name]
        if adapter.slot in used_slots:
            self._draining.add(adapter.slot)
        return adapter

    def release(self, used_slots: Collection[int]) -> None:
        """Free every draining slot no live request uses any more."""
        self._draining &= set(used_slots)
