"""LoRA adapters loaded while the engine serves: a load needing a slot that only paused requests of
an unloaded adapter hold ends them, a load that fails on its files ends none, and two loads at once
each take a slot of their own."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from tandem.client.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.backpressure import MAX_UNREAD_TOKENS
from tandem.decoder.engine.outputs.outputs import Accepted, Delta, Failed
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.engine.scheduling.adapters import Adapter

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12]


def engine(model_dir: Path, adapters: tuple[tuple[str, Path], ...], max_loras: int) -> Engine:
    """A started engine serving `adapters` from the start, in `max_loras` slots."""
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        num_kv_blocks=256,
        block_size=4,
        enable_lora=True,
        loras=adapters,
        max_loras=max_loras,
    )
    return Engine(config).start()


def test_a_load_needing_the_slot_of_an_unloaded_adapter_whose_requests_wait_for_readers_ends_them(
    tiny_model_dir: Path, adapters
) -> None:
    """A stream nobody reads pauses; once its adapter is unloaded, it keeps the slot while a load finds
    another one free, and a load that needs that slot ends it (FAILED_PRECONDITION naming the unload,
    after the tokens it had) instead of RESOURCE_EXHAUSTED for ever."""
    (qv4, qv4_path), (_, mlp8_path) = adapters
    stopping = StoppingParams(max_new_tokens=3 * MAX_UNREAD_TOKENS, ignore_eos=True)
    with engine(tiny_model_dir, adapters, max_loras=3) as e:
        reader = e.generate(GenerateSpec([PROMPT], SamplingParams(temperature=0.0), stopping, adapter=qv4))
        assert isinstance(next(reader), Accepted)  # then nothing is taken
        deadline = time.monotonic() + 60
        while e.core.scheduler.num_paused == 0:
            assert time.monotonic() < deadline, "never paused"
            time.sleep(0.01)
        assert e.unload_adapter(qv4) == 1
        asyncio.run(e.load_adapter("x", qv4_path))  # a free slot: the slow reader keeps its stream
        assert e.core.scheduler.num_paused == 1
        asyncio.run(e.load_adapter("y", mlp8_path))  # qv4's slot, held by the paused request alone
        assert [a.name for a in e.adapters] == ["mlp8", "x", "y"] and e.core.num_live() == 0
        blocks = e.core.block_manager
        assert blocks.num_free_blocks == blocks.num_total_blocks
        rest = list(reader)
        assert sum(len(event.token_ids) for event in rest if isinstance(event, Delta)) > MAX_UNREAD_TOKENS
        assert isinstance(rest[-1], Failed) and isinstance(rest[-1].error, FailedPrecondition)
        assert "adapter 'qv4' was unloaded while this request was paused" in rest[-1].error.message
        with pytest.raises(ResourceExhausted, match="each holds a loaded adapter: unload one first") as full:
            asyncio.run(e.load_adapter("z", qv4_path))
        assert full.value.retry_after_s is None  # only an UnloadAdapter frees a slot: no retry hint


def test_only_a_load_that_installs_ends_paused_requests_and_two_loads_take_two_such_slots(
    tiny_model_dir: Path, adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that fails on its files ends no paused request (it took no slot), and two loads at once,
    with two draining slots held only by paused requests, both load: each install takes a slot of its
    own (each check had only tested that one could be freed)."""
    (qv4, _), (mlp8, mlp8_path) = adapters
    stopping = StoppingParams(max_new_tokens=3 * MAX_UNREAD_TOKENS, ignore_eos=True)
    with engine(tiny_model_dir, adapters, max_loras=2) as e:
        readers = [
            e.generate(GenerateSpec([PROMPT], SamplingParams(temperature=0.0), stopping, adapter=name))
            for name in (qv4, mlp8)
        ]
        for reader in readers:
            assert isinstance(next(reader), Accepted)  # then nothing is taken
        deadline = time.monotonic() + 60
        while e.core.scheduler.num_paused < 2:
            assert time.monotonic() < deadline, "never paused"
            time.sleep(0.01)
        assert e.unload_adapter(qv4) == 1 and e.unload_adapter(mlp8) == 1
        with pytest.raises(InvalidArgument):
            asyncio.run(e.load_adapter("missing", tmp_path / "missing"))
        assert e.core.scheduler.num_paused == 2 and e.core.num_live() == 2

        # Both loads pass their checks before either installs (the reader thread checks the second
        # while the first waits for the engine thread), as they may when the engine is busy.
        checked = threading.Condition()
        num_checked = 0
        check, queue_install = e.core.check_can_load, e.core.between_steps

        def counted_check(name: str) -> None:
            nonlocal num_checked
            check(name)
            with checked:
                num_checked += 1
                checked.notify_all()

        def install_after_both_checks(fn):
            with checked:
                assert checked.wait_for(lambda: num_checked == 2, timeout=30)
            return queue_install(fn)

        monkeypatch.setattr(e.core, "check_can_load", counted_check)
        monkeypatch.setattr(e.core, "between_steps", install_after_both_checks)

        async def load_two() -> list[Adapter]:
            return await asyncio.gather(e.load_adapter("x", mlp8_path), e.load_adapter("y", mlp8_path))

        assert sorted(a.slot for a in asyncio.run(load_two())) == [0, 1]
        assert e.core.num_live() == 0
        for reader in readers:
            last = list(reader)[-1]
            assert isinstance(last, Failed) and "a LoadAdapter took its slot" in last.error.message
