"""The LoRA delta kernel (backends/cpu/lora.py, csrc/lora.c) on every build this CPU runs: the
reference's sums, a row's bits whatever shares the call, and the executor's per-op path with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.lora import CLora, bind_table
from tandem.decoder.models.loader import LoadedModel, load_model
from tandem.decoder.models.lora import PARTS, LoraStep, LoraTable
from tandem.decoder.models.peft_adapter import read_adapter
from tests.lora_adapters import SPECS, make_adapter

from ...models.helpers import PagedAllocator

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("adapters")
    return [
        make_adapter(tiny_model_dir, out / name, spec, seed=i) for i, (name, spec) in enumerate(SPECS.items())
    ]


def table_of(loaded: LoadedModel, adapters: list[Path]) -> LoraTable:
    table = LoraTable(loaded.config, max_loras=len(adapters), max_rank=16, device=torch.device("cpu"))
    for slot, path in enumerate(adapters):
        table.write(slot, read_adapter(path, loaded.config, max_rank=16))
    return table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_sums_as_the_reference_and_a_rows_bits_never_depend_on_the_others(
    kernels, tiny_model_dir: Path, adapters: list[Path], dtype: str
) -> None:
    loaded = load_model(tiny_model_dir, dtype=dtype)
    table = table_of(loaded, adapters)
    bound = bind_table(kernels, table)[2]
    generator = torch.Generator().manual_seed(0)
    for name in PARTS:
        projection, clora = table.layers[2][name], getattr(bound, name)
        x = torch.randn(41, projection.in_features, generator=generator).to(loaded.config.dtype)
        y = torch.randn(41, projection.out_features, generator=generator).to(loaded.config.dtype)
        slots = torch.randint(-1, 3, (41,), generator=generator)
        together = clora(x, y.clone(), slots)
        want = projection.add_delta(x, y.clone(), slots, table.scales)
        assert (together.float() - want.float()).abs().max() <= (1e-5 if dtype == "float32" else 0.05)
        assert torch.equal(together[slots < 0], y[slots < 0])
        for t in range(41):  # alone, and among other rows of other adapters
            assert torch.equal(clora(x[t : t + 1], y[t : t + 1].clone(), slots[t : t + 1])[0], together[t])
        shuffled = torch.randperm(41, generator=generator)
        assert torch.equal(clora(x[shuffled], y[shuffled].clone(), slots[shuffled]), together[shuffled])


def test_a_slot_outside_the_table_is_refused_and_nothing_written(
    kernels, tiny_fp32: LoadedModel, adapters: list[Path]
) -> None:
    table = table_of(tiny_fp32, adapters)
    clora = CLora(kernels, table.layers[0]["o_proj"], table.scales)
    x, y = torch.randn(2, clora.in_features), torch.randn(2, clora.out_features)
    before = y.clone()
    for bad in (3, -2):
        with pytest.raises(ValueError, match="a slot outside the table"):
            clora(x, y, torch.tensor([0, bad]))
    assert torch.equal(y, before)
    with pytest.raises(ValueError, match="slots must be a contiguous int64"):
        clora(x, y.clone(), torch.tensor([0, 1], dtype=torch.int32))


def step(
    run, loaded: LoadedModel, prompts: list[list[int]], slots: list[int], table: LoraTable
) -> torch.Tensor:
    """Each prompt's last-position logits, packed in one prefill step, its rows on its slot."""
    attn = PagedAllocator().metadata([(i, len(p)) for i, p in enumerate(prompts)])
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    row_slots = torch.tensor([s for p, s in zip(prompts, slots, strict=True) for _ in p])
    with torch.inference_mode():
        return run(
            ids, positions, attn, loaded.model.allocate_kv_cache(64, 4), lora=LoraStep(table, row_slots)
        )


def test_the_executor_runs_every_step_per_op_with_the_models_adapted_logits(
    kernels, tiny_model_dir: Path, adapters: list[Path]
) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    table = table_of(loaded, adapters)
    executor = CpuExecutor(loaded.model, kernels, linears="c", lora=table)
    assert not executor.choice.fused_layers and not executor.choice.decode_stack
    prompts = [PROMPT, PROMPT[:6], PROMPT[2:], PROMPT]
    slots = [0, 1, 2, -1]
    got = step(executor, loaded, prompts, slots, table)
    want = step(loaded.model, loaded, prompts, slots, table)  # the plain model, the reference delta
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # bf16 on the C linears: each row the same bits alone as in the step, adapted or not.
    for i, (prompt, slot) in enumerate(zip(prompts, slots, strict=True)):
        assert torch.equal(step(executor, loaded, [prompt], [slot], table)[0], got[i])
