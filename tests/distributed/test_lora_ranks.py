"""LoRA adapters on two gloo ranks: each rank holds its shard of every slot (models/lora.py), rank 0
sends each adapter it installs and each step's row slots to the others (step_broadcast.py), and the
tokens are transformers + peft's, for adapters loaded at start, loaded while the engine runs, and
loaded into a slot another adapter left."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.decoder.tests.lora_adapters import SPECS, make_adapter, peft_greedy

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
