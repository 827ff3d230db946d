"""The LoRA slots as the engine's live requests use them: a request's adapter resolved to its slot,
an unload that drains its slot, the drained slots freed, and a slot taken for a load.

scheduling/adapters.py knows which adapter each slot holds, by name; only the engine knows which
live requests still use a slot and which of them are paused for their readers, so what ends for a
load and when a draining slot is free is decided here. Every method runs under the engine's lock.
"""

from __future__ import annotations

from tandem.client.errors import FailedPrecondition, NotFound
from tandem.common.model_name import echo
from tandem.decoder.engine.outputs.outputs import Failed
from tandem.decoder.engine.request import Request
from tandem.decoder.engine.scheduling.adapters import Adapter, AdapterSlots
from tandem.decoder.engine.scheduling.scheduler import Scheduler
from tandem.decoder.engine.step.tracked import Tracked


class LiveAdapterSlots:
    """The LoRA slots as the step sees them: which adapter each live request holds, and which slot a
    load may take. It reads the core's own `live` dict and scheduler, the same objects (EngineCore
    only ever mutates its `_live`, never rebinds it: a new dict there would leave this one stale).
    Called under the core's lock, as the methods it came from (core.py) were."""

    def __init__(
        self,
        slots: AdapterSlots | None,  # the LoRA slots' names; None: LoRA off
        scheduler: Scheduler,
        live: dict[str, Tracked],  # the engine's live requests, by key: read, and emptied by take_slot
    ) -> None:
        self.slots = slots
        self.scheduler = scheduler
        self.live = live

    def resolve(self, request: Request) -> None:
        """The slot and cache salt of the adapter the request names; NotFound if none."""
        if self.slots is None:
            raise NotFound(f"adapter {echo(request.adapter)} is not loaded: this server runs without LoRA")
        adapter = self.slots.get(request.adapter)
        request.adapter_slot = adapter.slot
        request.cache_salt = adapter.cache_salt

    def unload(self, name: str) -> int:
        """Withdraw adapter `name` (NotFound if not loaded): new requests can no longer name it, and its
        slot is freed once its live requests have ended. Returns how many live requests still use it."""
        if self.slots is None:
            raise NotFound(f"adapter {echo(name)} is not loaded: this server runs without LoRA")
        slot = self.slots.remove(name, self._slots_in_use()).slot
        return sum(1 for t in self.live.values() if t.request.adapter_slot == slot)

    def loaded(self) -> list[Adapter]:
        return [] if self.slots is None else self.slots.adapters

    def check_can_load(self, name: str) -> None:
        """Raises unless an adapter could be loaded as `name` now: a new name, and a free slot or one
        `take_slot` could reclaim. Ends nothing: the load may still fail on its files, or its caller
        leave before the install."""
        if self.slots is None:
            raise FailedPrecondition("name", "this server runs without LoRA: start it with --enable-lora")
        self.slots.check_new(name)
        self.release_drained()
        if not self.slots.has_free_slot and self._reclaimable_slot() is None:
            self.slots.free_slot()  # raises: every slot taken

    def take_slot(self) -> int:
        """On the engine thread, by the install of an adapter read and checked: a free slot; where
        none is, the lowest draining slot that only requests paused for their readers use, whose
        requests end (FAILED_PRECONDITION naming the unload) and leave the engine (they hold no KV
        blocks). A paused request's reader may never read again, and unloading promised the slot
        back: it would otherwise be held for ever (issue: a stream nobody reads). Only here, where the
        load is sure to take the slot, so a load that fails on its files, or whose caller left, ends
        no one; a slow reader keeps its stream while no load needs its slot, and a running request is
        never ended. ResourceExhausted when no slot is free nor reclaimable."""
        assert self.slots is not None
        self.release_drained()
        slot = None if self.slots.has_free_slot else self._reclaimable_slot()
        if slot is not None:
            ended = [t for t in self.live.values() if t.request.adapter_slot == slot]
            for tracked in ended:
                self.scheduler.abort(tracked.request.request_id)
                del self.live[tracked.request.request_id]
                # Under the lock, as EngineCore.add's Accepted: the callbacks only post the event.
                tracked.on_event(Failed(tracked.output.request_id, unloaded_while_paused(tracked.request)))
            self.release_drained()
        return self.slots.free_slot()

    def release_drained(self) -> None:
        """Free the unloaded adapters' slots whose last request has ended."""
        if self.slots is not None and self.slots.num_draining:
            self.slots.release(self._slots_in_use())

    def _reclaimable_slot(self) -> int | None:
        """The lowest draining slot that no request but ones paused for their readers uses; None if
        there is none."""
        assert self.slots is not None
        users: dict[int, list[str]] = {slot: [] for slot in self.slots.draining}
        for tracked in self.live.values():
            if tracked.request.adapter_slot in users:
                users[tracked.request.adapter_slot].append(tracked.request.request_id)
        paused = self.scheduler.paused
        return min((s for s, keys in users.items() if all(key in paused for key in keys)), default=None)

    def _slots_in_use(self) -> set[int]:
        return {t.request.adapter_slot for t in self.live.values() if t.request.adapter_slot >= 0}


def unloaded_while_paused(request: Request) -> FailedPrecondition:
    """Why a request paused for its reader ended when a load took its unloaded adapter's slot: not
    retryable as it is (the adapter is gone), so no RESOURCE_EXHAUSTED."""
    return FailedPrecondition(
        "adapter",
        f"adapter {echo(request.adapter)} was unloaded while this request was paused for its reader "
        f"(its stream unread), and a LoadAdapter took its slot: the request ended after "
        f"{request.num_output_tokens} tokens",
    )
