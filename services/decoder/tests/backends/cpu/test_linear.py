"""The linears the executor binds: the C bf16 kernel (csrc/linear.c) against fp32 products rounded once,
oneDNN's prepacked bf16 against F.linear, and which one each weight gets.

The C kernel accumulates in fp32 and rounds once, as torch's bf16 linear does; only the order of the
fp32 sums differs, so a result is the fp32 product's rounding or, rarely, the bf16 value next to it.
It runs on every x86 CPU (an AVX-512 machine runs the AVX2 code too), so the tests bind it directly
wherever the executor would choose oneDNN.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tandem.decoder.backends.cpu import linear as cpu_linear
from tandem.decoder.backends.cpu.executor import CpuExecutor, bind_projections
from tandem.decoder.backends.cpu.linear import (
    CLinear,
    PackedLinear,
    TorchLinear,
    can_bind,
    can_prepack,
    has_onednn_bf16,
)
from tandem.decoder.models.kernels import ModelKernels
from tandem.decoder.models.linear import Projection
from tandem.decoder.models.loader import load_model

from ...conftest import Checkpoint
from ...models.helpers import PagedRun, greedy

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]


def rounded_once(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(torch.bfloat16)


def assert_within_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    step = expected.float().abs() * 2**-7 + 1e-30  # one bf16 step: 8 significant bits
    assert ((actual.float() - expected.float()).abs() <= step).all()


# Rows: a decode step of 1-3 sequences has its own tiles, 5-6 (a verification step of k = 4 or 5) one
# pass of 6 x 2 tiles, 4 and 7 or more groups of 4 plus 1-3 left over (9: a verification step of
# k = 8), all in the same pass over a block of weight rows; 300 rows of 1,000
# columns spans several row blocks. Output features: whole blocks of 24 weight rows, a partial one,
# several with a partial last. Columns: whole chunks of 16, a tail, fewer than one chunk. On an
# AVX512-BF16 build (packed weights): tiles of 1-4 rows by one group of 96 features, groups whole,
# partial, or one partial vector; odd columns (37, 25) end on a pair of their own.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 33, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 37), (7, 1000), (25, 5), (131, 48)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_equals_the_product_rounded_once(
    kernels, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    torch.manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    actual = CLinear(kernels, weight, bias)(x)
    assert_within_one_rounding(actual, rounded_once(x, weight, bias))


# 2,000 features are 21 groups of 96: each thread has a next group, which its 4-row tiles prefetch
# from 8 rows on, while a row alone streams its groups (packed weights).
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 8, 9, 17, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(131, 48), (50, 37), (30, 1000), (2000, 96)])
def test_a_rows_result_is_the_same_bits_whatever_rows_share_the_call(
    kernels, rows: int, out_features: int, in_features: int
) -> None:
    """Speculative decoding verifies k proposals as k + 1 rows of one step and promises the tokens a
    step per row would give: every row's sums must run in one order whatever tile computes them."""
    torch.manual_seed(rows + out_features)
    linear = CLinear(
        kernels,
        torch.randn(out_features, in_features).to(torch.bfloat16),
        torch.randn(out_features).to(torch.bfloat16),
    )
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    together = linear(x)
    for i in range(rows):
        assert torch.equal(together[i : i + 1], linear(x[i : i + 1].contiguous())), i


def test_the_packed_layout_holds_groups_of_96_features_pair_by_pair(kernels) -> None:
    """AVX512-BF16 builds read weights packed once at bind time (csrc/linear_packed.c): for group g
    of 96 features and input pair p, 96 dwords of (w[f][2p], w[f][2p + 1]), zero past n and k."""
    n, k = 100, 7
    weight = torch.randn(n, k).to(torch.bfloat16)
    packed = kernels.pack_weight(weight, layout=96).data
    kp, groups = (k + 1) // 2, 2
    assert packed.shape == (groups * 96 * 2 * kp,)
    view = packed.view(groups, kp, 96, 2)  # [group, pair, feature, half]
    padded = torch.zeros(groups * 96, 2 * kp, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    for g in range(groups):
        for p in range(kp):
            assert torch.equal(view[g, p], padded[96 * g : 96 * (g + 1), 2 * p : 2 * p + 2]), (g, p)
    assert kernels.pack_weight(weight, layout=0).data is weight


def test_an_empty_batch_gives_an_empty_result(kernels) -> None:
    weight = torch.randn(8, 16).to(torch.bfloat16)
    assert CLinear(kernels, weight, None)(torch.empty(0, 16, dtype=torch.bfloat16)).shape == (0, 8)


def test_the_bias_can_be_left_out_for_row_parallel_sums(kernels) -> None:
    weight, bias = torch.randn(24, 32).to(torch.bfloat16), torch.randn(24).to(torch.bfloat16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert_within_one_rounding(
        CLinear(kernels, weight, bias)(x, with_bias=False), rounded_once(x, weight, None)
    )


def test_inputs_the_kernel_cannot_read_are_refused_naming_the_argument(kernels) -> None:
    weight = torch.randn(8, 16).to(torch.bfloat16)
    bound = CLinear(kernels, weight, None)
    for bad in (
        torch.randn(2, 16),  # float32
        torch.randn(2, 12).to(torch.bfloat16),  # wrong width
        torch.randn(16, 2).to(torch.bfloat16).T,  # not contiguous
        torch.randn(2, 2, 16).to(torch.bfloat16),  # not 2-D
    ):
        with pytest.raises(
            ValueError, match=r"^x must be a contiguous bfloat16 CPU tensor of shape \[\*, 16\]"
        ):
            bound(bad)
    with pytest.raises(ValueError, match="^weight must be a contiguous 2-D bfloat16 or float32"):
        CLinear(kernels, weight.double(), None)
    with pytest.raises(ValueError, match=r"^bias must be a contiguous bfloat16 CPU tensor of shape \[8\]"):
        CLinear(kernels, weight, torch.zeros(9, dtype=torch.bfloat16))


def test_the_c_kernel_is_bound_only_to_weights_it_can_read_in_place() -> None:
    weight = torch.randn(8, 16).to(torch.bfloat16)
    assert can_bind(weight, None) and can_bind(weight, torch.zeros(8, dtype=torch.bfloat16))
    assert can_bind(weight.float(), torch.zeros(8))  # float32 (csrc/linear_f32.c), its bias too
    assert not can_bind(weight.double(), None)  # float64
    assert not can_bind(weight.float(), torch.zeros(8, dtype=torch.bfloat16))  # a bias of another dtype
    assert not can_bind(torch.randn(16, 8).to(torch.bfloat16).T, None)  # not contiguous
    assert not can_bind(torch.randn(2, 8, 16).to(torch.bfloat16), None)  # not 2-D
    assert not can_bind(torch.empty(8, 0, dtype=torch.bfloat16), None)  # no column
    assert not can_bind(weight, torch.zeros(8))  # a float32 bias


def test_an_executor_binds_every_bf16_linear_and_the_tied_head_to_the_c_kernel_where_onednn_cannot(
    kernels, checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_linear, "has_onednn_bf16", lambda: False)  # an AVX2-only CPU
    model = load_model(checkpoint.path, dtype="bfloat16").model
    executor = CpuExecutor(model, kernels)
    assert executor.choice.linears == "c" and executor.choice.fused_layers
    head = executor.kernels.head
    assert isinstance(head, CLinear)
    assert head.weight.data_ptr() == model.head_weight.data_ptr()  # the tied table, not a copy
    # Per layer too, where the layers are not fused: every projection on the C kernel.
    bound = [
        linear
        for layer in model.layers
        for linear in bind_projections(layer, "c", kernels, {}, False).values()
    ]
    assert len(bound) == 4 * len(model.layers) and all(isinstance(linear, CLinear) for linear in bound)


def test_float32_models_bind_the_c_float32_kernel_wherever_a_build_is_loaded(
    kernels, checkpoint: Checkpoint
) -> None:
    """MKL's float32 GEMM orders a row's sums by the row count; csrc/linear_f32.c does not. Without a
    build (or asked for torch's linears) they stay on F.linear."""
    model = load_model(checkpoint.path, dtype="float32").model

    def linears_of(executor: CpuExecutor) -> list[object]:
        layers = executor.kernels.layers
        return [p for k in layers for p in (k.qkv, k.o, k.gate_up, k.down)] + [executor.kernels.head]

    executor = CpuExecutor(model, kernels)
    assert executor.choice.linears == "c" and not executor.choice.fused_layers
    bound = linears_of(executor)
    assert all(type(linear) is CLinear and linear.weight.dtype == torch.float32 for linear in bound)
    assert executor.kernels.head.weight.data_ptr() == model.head_weight.data_ptr()  # in place, no copy
    for off in (CpuExecutor(model, None), CpuExecutor(model, kernels, linears="torch")):
        assert all(type(linear) is TorchLinear for linear in linears_of(off))


def test_bf16_greedy_tokens_on_the_linear_kernel_match_the_torch_linears(
    kernels, checkpoint: Checkpoint
) -> None:
    # The checkpoints' logits are far apart (initializer_range 0.1), so one-bit differences in the
    # projections cannot flip a greedy choice: the tokens must be the same.
    model = load_model(checkpoint.path, dtype="bfloat16").model
    expected = greedy(model, PROMPT, 16)
    # The linears alone, on torch ops for the rest; the other kernels are tested on their own.
    executor = CpuExecutor(model, None, linears="torch")

    def on_c(linear: Projection | None) -> CLinear:
        assert isinstance(linear, TorchLinear)
        return CLinear(kernels, linear.weight, linear.bias)

    plain = executor.kernels
    executor.kernels = ModelKernels(
        tuple(
            replace(k, qkv=on_c(k.qkv), o=on_c(k.o), gate_up=on_c(k.gate_up), down=on_c(k.down))
            for k in plain.layers
        ),
        on_c(plain.head),
    )
    run = PagedRun(model, step=executor)
    tokens = [int(run.step([("s", PROMPT)])[0].argmax())]
    while len(tokens) < 16:
        tokens.append(int(run.step([("s", tokens[-1:])])[0].argmax()))
    assert tokens == expected


# -- oneDNN's prepacked bf16 -----------------------------------------------------------------------


@pytest.mark.skipif(not has_onednn_bf16(), reason="this CPU's oneDNN has no bf16 path (AVX2 only)")
def test_prepacked_linear_gives_bit_identical_bf16_results() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(160, 96).bfloat16(), torch.randn(160).bfloat16()
    x = torch.randn(7, 96, dtype=torch.bfloat16)
    assert can_prepack(weight)
    packed = PackedLinear(weight, bias)
    assert torch.equal(packed(x), F.linear(x, weight, bias))
    assert torch.equal(packed(x, with_bias=False), F.linear(x, weight, None))


def test_prepack_is_skipped_where_onednn_has_no_bf16_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "has_onednn_bf16", lambda: False)
    assert not can_prepack(torch.zeros(4, 8, dtype=torch.bfloat16))


def test_prepack_leaves_float32_on_the_plain_path(checkpoint: Checkpoint) -> None:
    assert not can_prepack(torch.zeros(4, 8))
    model = load_model(checkpoint.path, dtype="float32").model
    executor = CpuExecutor(model, None, linears="onednn")  # asked for oneDNN: float32 stays on F.linear
    assert all(type(layer.qkv) is TorchLinear for layer in executor.kernels.layers)
