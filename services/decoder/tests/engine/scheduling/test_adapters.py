"""Which adapter each LoRA slot holds (scheduling/adapters.py): names, free slots, and slots that drain."""

from __future__ import annotations

import pytest

from tandem.client.errors import AlreadyExists, ErrorInfo, InvalidArgument, NotFound, ResourceExhausted
from tandem.decoder.engine.scheduling.adapters import AdapterSlots


def load(slots: AdapterSlots, name: str) -> int:
    return slots.add(name, f"/adapters/{name}", 8, ("q_proj",), slots.free_slot()).slot


def test_loads_take_the_lowest_free_slot_until_none_is_left() -> None:
    slots = AdapterSlots(max_loras=2)
    assert [load(slots, "a"), load(slots, "b")] == [0, 1]
    with pytest.raises(ResourceExhausted, match="all 2 LoRA slots") as caught:
        slots.free_slot()
    # drainingSlots 0: the ErrorInfo alone tells a program no wait helps, as the missing RetryInfo does.
    assert caught.value.info == ErrorInfo(
        "LORA_SLOTS", "tandem.decoder", {"maxLoras": "2", "drainingSlots": "0"}
    )
    assert "unload one first" in caught.value.message
    assert caught.value.retry_after_s is None  # only an UnloadAdapter frees one: a retry fails for ever
    assert [a.name for a in slots.adapters] == ["a", "b"]


def test_names_are_unique_bounded_and_looked_up_by_name() -> None:
    slots = AdapterSlots(max_loras=2)
    load(slots, "a")
    with pytest.raises(AlreadyExists, match="'a' is loaded already"):
        slots.check_new("a")
    with pytest.raises(InvalidArgument, match="must be 1 to 256 bytes"):
        slots.check_new("")
    with pytest.raises(NotFound, match=r"adapter 'b' is not loaded \(loaded: 'a'\)"):
        slots.get("b")


def test_an_unloaded_slot_in_use_drains_until_its_last_request_ends() -> None:
    slots = AdapterSlots(max_loras=1)
    slot = load(slots, "a")
    slots.remove("a", used_slots={slot})
    with pytest.raises(NotFound):
        slots.get("a")  # new requests can no longer name it
    with pytest.raises(ResourceExhausted, match="1 of them draining") as caught:
        slots.free_slot()  # its requests still read it
    assert caught.value.retry_after_s == 1.0  # they end, and a retry succeeds
    assert caught.value.info == ErrorInfo(
        "LORA_SLOTS", "tandem.decoder", {"maxLoras": "1", "drainingSlots": "1"}
    )
    assert slots.draining == {slot} and not slots.has_free_slot
    slots.release(used_slots={slot})
    assert slots.num_draining == 1
    slots.release(used_slots=set())
    assert slots.has_free_slot and slots.free_slot() == slot


def test_every_load_salts_the_prefix_cache_anew_even_under_one_name() -> None:
    slots = AdapterSlots(max_loras=2)
    load(slots, "a")
    first = slots.get("a").cache_salt
    slots.remove("a", used_slots=set())
    load(slots, "a")
    assert slots.get("a").cache_salt != first
