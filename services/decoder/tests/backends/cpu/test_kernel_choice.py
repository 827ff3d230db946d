"""The kernels chosen at load (backends/cpu/kernel_choice.py): --cpu-kernels naming a build (timing
nothing, refused where this CPU cannot run it), a model too small to measure, the executor logging the
choice, and a split step keeping decode rows on their exact kernel."""

from __future__ import annotations

import pytest
import torch

from tandem.client.errors import ConfigError
from tandem.decoder.backends.cpu import executor as cpu_executor
from tandem.decoder.backends.cpu import kernel_choice
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cpu.kernel_timing import projections
from tandem.decoder.backends.cpu.kernels import load_for_cpu
from tandem.decoder.backends.cpu.linear import PackedLinear, has_onednn_bf16
from tandem.decoder.backends.cpu.linear_plan import LinearPlan, Shape

from ...models.helpers import PagedRun
from .fake_measure import counted_measure


def test_cpu_kernels_names_a_build_and_nothing_is_timed(bf16_model, monkeypatch: pytest.MonkeyPatch) -> None:
    count = counted_measure(monkeypatch)
    lowest = this_cpu() and kernel_choice.runnable_levels(this_cpu())[0].name
    kernels, plan = kernel_choice.choose(bf16_model, KernelOptions(kernels=lowest))
    assert count[0] == 0 and kernels is not None and kernels.level.name == lowest
    assert plan is not None and plan.source == "--cpu-kernels" and {k for _, k in plan.exact} == {lowest}


def test_a_build_this_cpu_cannot_run_is_refused_naming_the_flag_and_what_it_needs() -> None:
    cpu = CpuInfo("x86_64", "an AVX2 CPU", frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()))
    with pytest.raises(
        ConfigError,
        match=r"^cpu_kernels: amx cannot run on this CPU \(it needs amx_bf16 amx_tile avx512_bf16 .*\); "
        r"it runs x86_64, avx2 \(or auto\)$",
    ):
        kernel_choice.check_kernels("amx", cpu)


# -- a split step -------------------------------------------------------------------------------------


@pytest.mark.skipif(not has_onednn_bf16(), reason="this CPU's oneDNN has no bf16 path: not a candidate")
def test_decode_rows_beside_a_prefill_chunk_on_onednn_keep_their_bits_alone(bf16_model) -> None:
    """With oneDNN for prefill chunks of 9+ rows, a step of one decode row and a 12-row chunk runs in
    two parts: the decode row gets the bits it gets alone, the chunk the model's tokens."""
    kernels = load_for_cpu()
    assert kernels is not None
    weights = [linear.weight for linear in projections(bf16_model)]
    shapes: list[Shape] = sorted({(w.shape[0], w.shape[1]) for w in weights})
    exact = tuple((s, kernels.level.name) for s in shapes)
    plan = LinearPlan(kernels.level.name, exact, tuple((s, "onednn") for s in shapes), 9, "test")
    executor = CpuExecutor(bf16_model, kernels, dense_rows=9, plan=plan)
    assert executor.split_rows == 9 and executor.prefill_layers
    assert all(isinstance(layer.gate_up, PackedLinear) for layer in executor.prefill_layers)
    chunk = [5, 17, 3, 99, 250, 31, 7, 8, 64, 12, 1000, 3]
    together, alone = PagedRun(bf16_model, step=executor), PagedRun(bf16_model, step=executor)
    for run in (together, alone):
        run.step([("a", [17, 402, 33, 981, 5])])
    mixed = together.step([("a", [42]), ("b", chunk)])
    assert torch.equal(mixed[0], alone.step([("a", [42])])[0])
    reference = PagedRun(bf16_model).step([("b", chunk)])[0]
    assert int(mixed[1].argmax()) == int(reference.argmax())


def test_a_model_too_small_to_pay_for_a_measurement_keeps_the_flags_choice(
    bf16_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = counted_measure(monkeypatch)
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_BYTES", 16 << 20)  # the tiny checkpoints: < 1 MB
    kernels, plan = kernel_choice.choose(bf16_model, KernelOptions(exact_rows=16, max_rows=256))
    assert count[0] == 0 and plan is None and kernels is load_for_cpu()


def test_the_executor_logs_the_measured_choice(bf16_model, monkeypatch: pytest.MonkeyPatch) -> None:
    counted_measure(monkeypatch)
    executor = cpu_executor.bind(bf16_model, KernelOptions(exact_rows=16, max_rows=256))
    assert f"{executor.choice.build} build (measured); linears " in executor.choice.describe()
