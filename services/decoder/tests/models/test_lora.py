"""LoRA slots in the model (models/lora.py): peft's logits per row, the base model's bits at slot -1,
and a row's delta independent of the rows beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.tests.lora_adapters import SPECS, make_adapter
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import LoadedModel, load_model
from tandem.decoder.models.lora import LoraStep, LoraTable
from tandem.decoder.models.peft_adapter import read_adapter

from .helpers import PagedAllocator

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_model_dir, out / name, spec, seed=i)
        for i, (name, spec) in enumerate(SPECS.items())
    }


def table_of(loaded: LoadedModel, adapters: dict[str, Path]) -> LoraTable:
    """Slot i holds the i-th adapter of SPECS."""
    table = LoraTable(loaded.config, max_loras=len(adapters), max_rank=16, device=torch.device("cpu"))
    for slot, path in enumerate(adapters.values()):
        table.write(slot, read_adapter(path, loaded.config, max_rank=16))
    return table


def logits(loaded: LoadedModel, prompts: list[list[int]], slots: list[int], table: LoraTable | None):
    """Every position's logits of `prompts` packed in one step, each prompt's rows on its slot."""
    model = loaded.model
    attn = PagedAllocator().metadata([(i, len(p)) for i, p in enumerate(prompts)], all_logits=True)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    row_slots = torch.tensor([s for p, s in zip(prompts, slots, strict=True) for _ in p])
    lora = None if table is None else LoraStep(table, row_slots)
    with torch.inference_mode():
        return model(ForwardBatch(ids, positions, attn, lora=lora), model.allocate_kv_cache(64, 4))


def test_each_rows_logits_are_peft_s_for_its_own_adapter_in_one_step(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, adapters: dict[str, Path]
) -> None:
    import peft
    import transformers

    table = table_of(tiny_fp32, adapters)
    got = logits(tiny_fp32, [PROMPT] * 4, [0, 1, 2, -1], table).view(4, len(PROMPT), -1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for i, path in enumerate(adapters.values()):
        model = peft.PeftModel.from_pretrained(hf, path)
        with torch.no_grad():
            want = model(torch.tensor([PROMPT])).logits[0]
            if i == 0:
                with model.disable_adapter():
                    base = model(torch.tensor([PROMPT])).logits[0]
        assert (got[i] - want).abs().max() < 1e-4, list(adapters)[i]
        assert (got[i] - base).abs().max() > 0.1  # the adapter changes the answer
        hf = model.unload()
    assert (got[3] - base).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_base_row_is_the_base_models_bits_whatever_adapter_its_neighbour_uses(
    tiny_model_dir: Path, adapters: dict[str, Path], dtype: str
) -> None:
    # The same step shapes throughout: torch's own float32 GEMM may block by the row count (the CPU
    # executor's kernels do not: backends/cpu/test_lora.py), which is not the adapters' doing.
    loaded = load_model(tiny_model_dir, dtype=dtype)
    table = table_of(loaded, adapters)
    prompts = [PROMPT, PROMPT[:7]]
    without = logits(loaded, prompts, [-1, -1], None)
    for neighbour in (-1, 0, 2):
        beside = logits(loaded, prompts, [-1, neighbour], table)
        assert torch.equal(beside[: len(PROMPT)], without[: len(PROMPT)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_delta_is_the_same_bits_alone_and_among_others(
    tiny_fp32: LoadedModel, adapters: dict[str, Path], dtype: torch.dtype
) -> None:
    table = table_of(tiny_fp32, adapters)
    generator = torch.Generator().manual_seed(0)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        projection = table.layers[1][name]
        projection.a, projection.bt = projection.a.to(dtype), projection.bt.to(dtype)
        x = torch.randn(37, projection.in_features, generator=generator).to(dtype)
        y = torch.randn(37, projection.out_features, generator=generator).to(dtype)
        slots = torch.randint(-1, 3, (37,), generator=generator)
        together = projection.add_delta(x, y.clone(), slots, table.scales)
        for t in range(37):
            alone = projection.add_delta(x[t : t + 1], y[t : t + 1].clone(), slots[t : t + 1], table.scales)
            assert torch.equal(alone[0], together[t]), (name, t)
        assert torch.equal(together[slots < 0], y[slots < 0])
