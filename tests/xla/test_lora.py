"""LoRA adapters on the XLA device (backends/xla/lora.py): the CPU engine's tokens for the base model
and three adapters in one running batch, through prefill and decode graphs, speculation's verify rows
and embedding prompts; adapters loaded and unloaded while serving; and not one graph compiled after
warmup for any of it (every graph adds every slot's delta, whatever the step's adapters)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.decoder.tests.engine.engine_helpers import run_concurrently
from tandem.common.torch_part.prompt_parts import EmbeddingPrompt, PromptPart
from tandem.decoder.backends.xla import runtime
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.outputs.outputs import Delta, Event, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.engine.step.xla_runner import XlaRunner
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.peft_weights import module_shapes
from tests.xla.helpers import engine_on, settings, table_rows

# (rank, lora_alpha, target modules): a part of the fused q/k/v, the MLP, all seven.
ADAPTERS = {
    "qv4": (4, 8.0, ("q_proj", "v_proj")),
    "mlp8": (8, 16.0, ("o_proj", "gate_proj", "down_proj")),
    "all16": (16, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "late": (4, 4.0, ("k_proj", "up_proj")),  # loaded while serving, into the slot qv4 leaves
}
LORA = dict(enable_lora=True, max_loras=3, max_lora_rank=16, speculative_max_batch=4)


def write_adapter(model_dir: Path, out_dir: Path, name: str, seed: int) -> Path:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A and B,
    written directly: peft is not in this venv."""
    rank, alpha, targets = ADAPTERS[name]
    config = load_model(model_dir, dtype="float32").config
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            out_features, in_features = shapes[module]
            block = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.2
    out_dir.mkdir(parents=True)
    settings_file = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}
    (out_dir / "adapter_config.json").write_text(json.dumps(settings_file))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("xla-lora")
    return {name: write_adapter(tiny_model_dir, root / name, name, seed=i) for i, name in enumerate(ADAPTERS)}


def _specs(model_dir: Path, names: list[str]) -> list[GenerateSpec]:
    """Per adapter ("" = the base model): a token prompt that speculates (a repeating pattern), and a
    prompt of embedding rows between token IDs."""
    specs = []
    for i, name in enumerate(names):
        ids = [(7 * (j % 5) + 3 * i) % 900 + 1 for j in range(9 + 4 * i)]
        mixed: list[PromptPart] = [ids[:2], EmbeddingPrompt(table_rows(model_dir, ids[2:7], seed=i)), ids[7:]]
        for prompt, speculate in (([ids], 3), (mixed, 0)):
            specs.append(
                GenerateSpec(
                    prompt,
                    SamplingParams(temperature=0.0),
                    StoppingParams(max_new_tokens=10, ignore_eos=True),
                    speculative_tokens=speculate,
                    adapter=name,
                )
            )
    return specs


def _tokens(events: list[Event]) -> list[int]:
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def test_adapters_on_xla_give_the_cpu_tokens_and_compile_nothing_after_warmup(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    first = ["", "qv4", "mlp8", "all16"]
    second = ["", "late", "mlp8", "all16"]
    at_start = tuple((name, adapters[name]) for name in ("qv4", "mlp8", "all16"))
    values = settings(tiny_model_dir, **LORA, loras=at_start)
    with engine_on("cpu", **values) as cpu:
        want_first = [_tokens(e) for e in run_concurrently(cpu, _specs(tiny_model_dir, first))]
        cpu.unload_adapter("qv4")
        asyncio.run(cpu.load_adapter("late", str(adapters["late"])))
        want_second = [_tokens(e) for e in run_concurrently(cpu, _specs(tiny_model_dir, second))]
    assert len({tuple(t) for t in want_first[::2]}) == 4  # every adapter changes the answer

    with engine_on("neuron", **values) as xla:
        runner = xla.core.runner
        assert isinstance(runner, XlaRunner)
        compiled = runtime.num_compiles()
        got_first = [_tokens(e) for e in run_concurrently(xla, _specs(tiny_model_dir, first))]
        xla.unload_adapter("qv4")
        asyncio.run(xla.load_adapter("late", str(adapters["late"])))
        got_second = [_tokens(e) for e in run_concurrently(xla, _specs(tiny_model_dir, second))]
        base_alone = [_tokens(e) for e in run_concurrently(xla, _specs(tiny_model_dir, [""]))]
        assert runtime.num_compiles() == compiled and runner.num_compiles_after_warmup == 0
        assert xla.core.num_proposed_tokens > 0  # verify rows ran in decode graphs with adapters
    assert got_first == want_first
    assert got_second == want_second
    assert base_alone == want_first[:2]  # a base row beside adapted ones is the base row alone
