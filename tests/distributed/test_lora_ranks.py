"""LoRA adapters on two gloo ranks: each rank holds its shard of every slot (models/lora.py), rank 0
sends each adapter it installs and each step's row slots to the others (step_broadcast.py), and the
tokens are transformers + peft's, for adapters loaded at start, loaded while the engine runs, and
loaded into a slot another adapter left; an install the other ranks miss takes the group down."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch

from services.decoder.tests.lora_adapters import SPECS, make_adapter, peft_greedy
from tandem.client.errors import Unavailable
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Failed

from . import scenarios
from .harness import run_ranks

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 17, 402, 33]  # 13 tokens: odd, padded under SP
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-ranks")
    specs = [
        ("qv4", SPECS["qv4"]),
        ("mlp8", SPECS["mlp8"]),
        ("all16", SPECS["all16"]),
        ("qv4b", SPECS["qv4"]),
    ]
    return {
        name: make_adapter(tiny_model_dir, root / name, spec, seed=i) for i, (name, spec) in enumerate(specs)
    }


def test_two_ranks_serve_every_adapter_with_peft_s_tokens(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    want = {"": peft_greedy(tiny_model_dir, None, PROMPT, NUM_TOKENS)}
    for name, path in adapters.items():
        want[name] = peft_greedy(tiny_model_dir, path, PROMPT, NUM_TOKENS)
    assert len({tuple(tokens) for tokens in want.values()}) == 5  # every adapter changes the answer

    rank0, rank1 = run_ranks(
        scenarios.rank_lora_tokens, 2, tiny_model_dir, adapters, PROMPT, NUM_TOKENS, timeout_s=180
    )
    assert rank1 is None  # the worker ran until rank 0's STOP
    first, second, slots = rank0
    assert first == {name: want[name] for name in ("", "qv4", "mlp8", "all16")}
    assert second == {name: want[name] for name in ("", "qv4", "all16", "qv4b")}
    assert slots == {"qv4": 0, "all16": 2, "qv4b": 1}  # qv4b took the slot mlp8 left


class LoneRank:
    """A group of one whose collectives are the identity, and whose feed to the (absent) other ranks
    records steps and fails every adapter install, as a broadcast to a lost rank does."""

    rank, world_size, timeout_s = 0, 1, 60.0
    rank_tensor = torch.tensor(0)

    def __init__(self) -> None:
        self.steps = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    all_gather_seq = reduce_scatter_seq = all_gather_last = all_reduce

    def all_gather_control(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0)

    def step_sender(self) -> LoneRank:
        return self

    def send(self, batch) -> None:
        self.steps += 1

    def install_adapter(self, slot: int, adapter) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    def keepalive(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def abort(self) -> None:
        pass


def test_an_adapter_install_the_other_ranks_miss_fails_the_group_not_only_the_load(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """The ranks would disagree on the slot's weights from then on: every open stream ends
    UNAVAILABLE and the engine stops, as after a failed step broadcast."""
    config = dataclasses.replace(scenarios.engine_config(tiny_model_dir), enable_lora=True, max_loras=2)
    group = LoneRank()
    engine = Engine(config, tp=group).start()  # type: ignore[arg-type]
    try:
        spec = scenarios.greedy_spec(PROMPT, 200)
        events: list = []
        engine.submit(spec, events.append)
        while group.steps < 3:
            time.sleep(0.01)
        with pytest.raises(Unavailable, match="the decoder engine failed"):
            asyncio.run(engine.load_adapter("qv4", str(adapters["qv4"])))
        deadline = time.monotonic() + 30
        while not any(isinstance(e, Failed) for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(events[-1], Failed) and isinstance(events[-1].error, Unavailable)
        assert not engine.is_healthy
    finally:
        engine.shutdown()
