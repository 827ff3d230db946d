"""The LoRA delta kernel (backends/cpu/lora.py, csrc/lora.c) on every build this CPU runs: the
reference's sums, a row's bits whatever shares the call, and the executor's paths with it (the fused
layers, the decode stack, the per-op path, a step split around a prompt chunk): the model's logits, a
row's bits alone and among others, a base row's bits with LoRA on or off, and a bad slot refused
before anything is written."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from services.decoder.tests.lora_adapters import SPECS, make_adapter
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.linear import has_onednn_bf16
from tandem.decoder.backends.cpu.linear_plan import LinearPlan
from tandem.decoder.backends.cpu.lora import CLora, bind_table
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import LoadedModel, load_model
from tandem.decoder.models.lora import PARTS, LoraStep, LoraTable, ProjectionLora
from tandem.decoder.models.peft_adapter import read_adapter

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


def check_rows(
    clora: CLora, projection: ProjectionLora, scales: torch.Tensor, generator: torch.Generator
) -> None:
    """41 rows of 3 slots and the base: the reference's sums, and each row's bits alone and shuffled
    among the others (the kernel groups them by slot in tiles of every size)."""
    dtype = projection.a.dtype
    x = torch.randn(41, projection.in_features, generator=generator).to(dtype)
    y = torch.randn(41, projection.out_features, generator=generator).to(dtype)
    slots = torch.randint(-1, 3, (41,), generator=generator)
    together = clora(x, y.clone(), slots)
    want = projection.add_delta(x, y.clone(), slots, scales)
    assert (together.float() - want.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 0.05)
    assert torch.equal(together[slots < 0], y[slots < 0])
    for t in range(41):  # alone, and among other rows of other adapters
        assert torch.equal(clora(x[t : t + 1], y[t : t + 1].clone(), slots[t : t + 1])[0], together[t])
    shuffled = torch.randperm(41, generator=generator)
    assert torch.equal(clora(x[shuffled], y[shuffled].clone(), slots[shuffled]), together[shuffled])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_sums_as_the_reference_and_a_rows_bits_never_depend_on_the_others(
    kernels, tiny_model_dir: Path, adapters: list[Path], dtype: str
) -> None:
    loaded = load_model(tiny_model_dir, dtype=dtype)
    table = table_of(loaded, adapters)
    bound = bind_table(kernels, table)[2]
    generator = torch.Generator().manual_seed(0)
    for name in PARTS:
        check_rows(getattr(bound, name), table.layers[2][name], table.scales, generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sizes_off_every_vector_width_take_the_kernels_tails_with_the_same_promises(
    kernels, tiny_fp32: LoadedModel, dtype: torch.dtype
) -> None:
    # Inputs 60, 72 and 300 and parts ending at 60, 80, 100, 300 and 600: the tails of the sums over
    # the inputs (16 and 32 lanes) and of the output columns (tiles of 64, vectors of 16).
    config = dataclasses.replace(
        tiny_fp32.config, hidden_size=72, intermediate_size=300, num_heads=3, num_kv_heads=1, head_dim=20
    )
    generator = torch.Generator().manual_seed(1)
    scales = torch.tensor([0.5, 2.0, 1.25])
    for name in PARTS:
        projection = ProjectionLora(config, name, max_loras=3, max_rank=16, dtype=dtype)
        projection.ranks = torch.randint(0, 17, projection.ranks.shape, generator=generator)
        for (slot, p), rank in zip(itertools.product(range(3), range(len(projection.parts))),
                                   projection.ranks.flatten().tolist(), strict=True):  # fmt: skip
            start, end = ((0,) + projection.part_ends)[p], projection.part_ends[p]
            a = torch.randn(rank, projection.in_features, generator=generator) * 0.1
            projection.a[slot, p * 16 : p * 16 + rank] = a.to(dtype)
            b = torch.randn(rank, end - start, generator=generator) * 0.1
            projection.bt[slot, :rank, start:end] = b.to(dtype)
        check_rows(CLora(kernels, projection, scales), projection, scales, generator)


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


class LoraRun:
    """Steps of `run` (an executor or the model) over its own paged KV cache, each row on its slot."""

    def __init__(self, run, loaded: LoadedModel, table: LoraTable) -> None:
        self.run, self.table = run, table
        self.allocator = PagedAllocator()
        self.kv_caches = loaded.model.allocate_kv_cache(128, 4)

    def step(self, chunks: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """Each chunk's (sequence, new tokens, slot) last-position logits, the chunks packed in one step."""
        starts = [self.allocator.seq_lens.get(key, 0) for key, _, _ in chunks]
        attn = self.allocator.metadata([(key, len(ids)) for key, ids, _ in chunks])
        ids = torch.tensor([t for _, tokens, _ in chunks for t in tokens], dtype=torch.int32)
        positions = torch.tensor(
            [p for s, (_, t, _) in zip(starts, chunks, strict=True) for p in range(s, s + len(t))]
        )
        slots = torch.tensor([slot for _, tokens, slot in chunks for _ in tokens])
        with torch.inference_mode():
            batch = ForwardBatch(ids, positions, attn, lora=LoraStep(self.table, slots))
            return self.run(batch, self.kv_caches)


SEQUENCES = {"a": (PROMPT, 0), "b": (PROMPT[:6], 1), "c": (PROMPT[2:], 2), "d": (PROMPT, -1)}  # prompt, slot


def generate(run: LoraRun, names: str, steps: int = 4) -> list[torch.Tensor]:
    """The sequences `names` prefilled in one step, then `steps` decode steps of them all (one token each,
    the same tokens whatever the run): every step's logits."""
    out = [run.step([(n, SEQUENCES[n][0], SEQUENCES[n][1]) for n in names])]
    for i in range(steps):
        out.append(run.step([(n, [(40 * i + 7 * ord(n)) % 1000], SEQUENCES[n][1]) for n in names]))
    return out


def test_steps_with_adapters_keep_the_fused_layers_and_the_stack_with_the_models_logits(
    kernels, tiny_model_dir: Path, adapters: list[Path]
) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    table = table_of(loaded, adapters)
    executor = CpuExecutor(loaded.model, kernels, linears="c", lora=table)
    assert executor.choice.fused_layers and executor.choice.decode_stack
    together = generate(LoraRun(executor, loaded, table), "abcd")
    reference = generate(LoraRun(loaded.model, loaded, table), "abcd")  # the plain model's torch deltas
    for got, want in zip(together, reference, strict=True):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    # A row's bits: the same alone, through the stack or the per-layer fused calls (decode steps), and
    # a base row's with LoRA off (an executor without slots).
    per_layer = CpuExecutor(loaded.model, kernels, linears="c", use_stack=False, lora=table)
    assert per_layer.choice.fused_layers and not per_layer.choice.decode_stack
    by_layer = generate(LoraRun(per_layer, loaded, table), "abcd")
    assert all(torch.equal(g, w) for g, w in zip(by_layer, together, strict=True))
    for i, name in enumerate("abcd"):
        alone = generate(LoraRun(executor, loaded, table), name)
        assert all(torch.equal(g[0], w[i]) for g, w in zip(alone, together, strict=True)), name
    plain = CpuExecutor(loaded.model, kernels, linears="c")

    def lora_off(batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return plain(dataclasses.replace(batch, lora=None), kv_caches)

    without = generate(LoraRun(lora_off, loaded, table), "d")
    assert all(torch.equal(g[0], w[3]) for g, w in zip(without, together, strict=True))


def test_the_per_op_path_adds_the_c_deltas_after_its_linears(
    kernels, tiny_model_dir: Path, adapters: list[Path]
) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    table = table_of(loaded, adapters)
    executor = CpuExecutor(loaded.model, kernels, linears="torch", lora=table)  # torch linears: per op
    assert not executor.choice.fused_layers and executor.kernels.layers[0].lora is not None
    got = generate(LoraRun(executor, loaded, table), "abcd", steps=2)
    want = generate(LoraRun(loaded.model, loaded, table), "abcd", steps=2)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 0.05 * w.abs().max()
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_a_slot_outside_the_table_is_refused_by_the_fused_layers_and_the_stack_before_any_write(
    kernels, tiny_model_dir: Path, adapters: list[Path]
) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    table = table_of(loaded, adapters)
    executor = CpuExecutor(loaded.model, kernels, linears="c", lora=table)
    run = LoraRun(executor, loaded, table)
    with pytest.raises(ValueError, match="lora_slots: a slot outside the LoRA table"):
        run.step([("a", PROMPT, 0), ("b", PROMPT, 3)])  # a prefill step: the fused halves
    assert all(c.count_nonzero() == 0 for c in run.kv_caches)
    run = LoraRun(executor, loaded, table)
    run.step([("a", PROMPT, 0), ("b", PROMPT, 1)])
    before = [c.clone() for c in run.kv_caches]
    with pytest.raises(ValueError, match="lora_slots: a slot outside the LoRA table"):
        run.step([("a", [5], 0), ("b", [6], -2)])  # a decode step: the stack
    assert all(torch.equal(c, b) for c, b in zip(run.kv_caches, before, strict=True))


def test_a_float16_model_runs_its_adapters_on_torchs_deltas_beside_the_kernels(
    kernels, tiny_model_dir: Path, adapters: list[Path]
) -> None:
    """The C delta takes float32 and bf16 rows only: a float16 model's slots stay unbound (binding them
    raised, and the decoder died after "listening"), and its logits are the torch reference's, as with
    --native-kernels false."""
    loaded = load_model(tiny_model_dir, dtype="float16")
    table = table_of(loaded, adapters)
    executor = CpuExecutor(loaded.model, kernels, lora=table)
    assert executor.c_lora is None
    got = generate(LoraRun(executor, loaded, table), "abcd", steps=2)
    want = generate(LoraRun(loaded.model, loaded, table), "abcd", steps=2)
    for g, w in zip(got, want, strict=True):
        assert (g.float() - w.float()).abs().max() <= 1e-2 * w.float().abs().max()


@pytest.mark.skipif(not has_onednn_bf16(), reason="this CPU's oneDNN has no bf16 path: not a candidate")
def test_a_split_step_gives_each_part_its_own_rows_slots(
    kernels, tiny_model_dir: Path, adapters: list[Path]
) -> None:
    """With prompt chunks of 9+ rows on oneDNN (prefill_split.py), a step of adapted decode rows beside an
    adapted 10-row chunk runs in two parts, each with its own rows' slots: the decode rows keep the bits
    they get alone, the chunk gets its adapter's logits."""
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    table = table_of(loaded, adapters)
    shapes = sorted({(w.shape[0], w.shape[1]) for w in _projection_weights(loaded)})
    exact = tuple((s, kernels.level.name) for s in shapes)
    plan = LinearPlan(kernels.level.name, exact, tuple((s, "onednn") for s in shapes), 9, "test")
    executor = CpuExecutor(loaded.model, kernels, dense_rows=9, plan=plan, lora=table)
    assert executor.split_rows == 9 and executor.prefill_layers
    mixed, alone = LoraRun(executor, loaded, table), LoraRun(executor, loaded, table)
    for run in (mixed, alone):
        run.step([("a", PROMPT[:4], 0), ("b", PROMPT[:3], 1)])
    together = mixed.step([("a", [42], 0), ("b", [7], 1), ("c", PROMPT, 2)])
    assert torch.equal(together[:2], alone.step([("a", [42], 0), ("b", [7], 1)]))
    want = LoraRun(loaded.model, loaded, table).step([("c", PROMPT, 2)])[0]  # the torch reference
    assert (together[2] - want).abs().max() <= 0.05 * want.abs().max()
    base = LoraRun(loaded.model, loaded, table).step([("c", PROMPT, -1)])[0]
    assert (together[2] - base).abs().max() > 10 * (together[2] - want).abs().max()  # the adapter applied


def _projection_weights(loaded: LoadedModel) -> list[torch.Tensor]:
    return [
        linear.weight
        for layer in loaded.model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
