"""The LoRA slots as live requests use them (`step/adapter_slots.py`): an unloaded adapter's slot
drains while requests use it, and a load that finds no free slot takes one that only requests paused
for their readers hold, ending them, but never one a running request holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.client.errors import FailedPrecondition, NotFound, ResourceExhausted
from tandem.decoder.engine.outputs.outputs import Failed
from tandem.decoder.engine.scheduling.adapters import AdapterSlots
from tandem.decoder.engine.step.adapter_slots import LiveAdapterSlots


class _Scheduler:
    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.aborted: list[str] = []

    def abort(self, key: str) -> None:
        self.aborted.append(key)


def _engine(max_loras: int = 1) -> tuple[LiveAdapterSlots, _Scheduler, dict]:
    slots = AdapterSlots(max_loras)
    for i, name in enumerate(["qv4", "mlp8"][:max_loras]):
        slots.add(name, f"/adapters/{name}", 4, ("q_proj",), slots.free_slot())
        assert slots.get(name).slot == i
    scheduler, live = _Scheduler(), {}
    return LiveAdapterSlots(slots, scheduler, live), scheduler, live  # type: ignore[arg-type]


def _admit(adapters: LiveAdapterSlots, live: dict, key: str, adapter: str) -> SimpleNamespace:
    request = SimpleNamespace(
        request_id=key, adapter=adapter, adapter_slot=-1, cache_salt=b"", num_output_tokens=3
    )
    adapters.resolve(request)  # type: ignore[arg-type]
    events: list[object] = []
    live[key] = tracked = SimpleNamespace(
        request=request, output=SimpleNamespace(request_id=f"caller-{key}"), on_event=events.append
    )
    tracked.events = events
    return tracked


def test_a_request_resolves_its_adapter_to_its_slot_and_salt() -> None:
    adapters, _, live = _engine(max_loras=2)
    tracked = _admit(adapters, live, "r1", "mlp8")
    assert tracked.request.adapter_slot == 1
    assert tracked.request.cache_salt == adapters.slots.get("mlp8").cache_salt  # type: ignore[union-attr]


def test_an_unloaded_slot_drains_until_its_last_request_ends() -> None:
    adapters, _, live = _engine()
    _admit(adapters, live, "r1", "qv4")
    assert adapters.unload("qv4") == 1
    adapters.release_drained()
    assert adapters.slots.draining == {0}  # type: ignore[union-attr]
    del live["r1"]
    adapters.release_drained()
    assert adapters.slots.draining == frozenset() and adapters.take_slot() == 0  # type: ignore[union-attr]


def test_a_load_takes_a_slot_only_paused_requests_hold_and_ends_them() -> None:
    adapters, scheduler, live = _engine()
    paused = _admit(adapters, live, "r1", "qv4")
    scheduler.paused.add("r1")
    adapters.unload("qv4")
    adapters.check_can_load("new")  # ends nothing
    assert live.keys() == {"r1"} and paused.events == []
    assert adapters.take_slot() == 0
    assert live == {} and scheduler.aborted == ["r1"]
    [event] = paused.events
    assert isinstance(event, Failed) and event.request_id == "caller-r1"
    assert isinstance(event.error, FailedPrecondition) and event.error.field == "adapter"
    assert "'qv4' was unloaded" in event.error.description and "after 3 tokens" in event.error.description


def test_a_slot_a_running_request_holds_is_never_taken() -> None:
    adapters, scheduler, live = _engine()
    running = _admit(adapters, live, "r1", "qv4")
    _admit(adapters, live, "r2", "qv4")
    scheduler.paused.add("r2")  # one paused beside a running one: the slot is not reclaimable
    adapters.unload("qv4")
    with pytest.raises(ResourceExhausted, match="draining"):
        adapters.check_can_load("new")
    with pytest.raises(ResourceExhausted, match="draining"):
        adapters.take_slot()
    assert live.keys() == {"r1", "r2"} and scheduler.aborted == [] and running.events == []


def test_without_lora_every_use_names_the_flag_or_the_adapter() -> None:
    adapters = LiveAdapterSlots(None, _Scheduler(), {})  # type: ignore[arg-type]
    assert adapters.loaded() == []
    with pytest.raises(NotFound, match="'qv4' is not loaded: this server runs without LoRA"):
        adapters.resolve(SimpleNamespace(adapter="qv4"))  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="without LoRA"):
        adapters.unload("qv4")
    with pytest.raises(FailedPrecondition, match="--enable-lora"):
        adapters.check_can_load("qv4")
