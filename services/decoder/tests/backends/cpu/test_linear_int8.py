"""Quantized linears with int8 activations (csrc/linear_int8.c, --quantized-activations int8).

Each row's inputs are rounded per block of 32 to d q (d = max |x| / 127, q = x / d to the nearest
integer, ties to even), and each output is the product of those rounded inputs with the weight's own
values, summed in fp32 in one order: against the float64 product of the rounded inputs it is within
fp32 summation error (float32 outputs) or one bf16 rounding; against the float64 product of the
inputs as given, within the rounding's bound, half a step an input. A row's bits do not depend on the
rows or threads beside it, nor on the build.
"""

from __future__ import annotations

import pytest
import torch

from services.decoder.tests.backends.cpu.test_linear_quant import KINDS
from tandem.common.torch_part.quantized_tensor import BLOCK, QuantizedTensor
from tandem.decoder.backends.cpu import isa
from tandem.decoder.backends.cpu.kernels import Kernels, load
from tandem.decoder.backends.cpu.linear import QuantLinear


def int8_linear(
    kernels: Kernels,
    weight: QuantizedTensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    dense_rows: int = 0,
) -> QuantLinear:
    return QuantLinear(
        kernels, kernels.quantized_weight(weight, dense_rows, int8_activations=True), bias, dtype
    )


def rounded_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] as float64, scales d [m, k / 32] as float64) as the kernel rounds x, each float32
    operation reproduced exactly (computed in float64 and rounded once: exact for / and *)."""
    m, k = x.shape
    v = x.float().view(m, k // BLOCK, BLOCK)
    d = (v.abs().amax(dim=-1).double() / 127).float()  # [m, blocks]
    inverse = torch.where(d > 0, (1 / d.double()).float(), torch.zeros_like(d))
    q = (v.double() * inverse.double()[..., None]).float().round()  # ties to even
    return q.view(m, k).double(), d.double()


def assert_is_the_product_of_the_rounded_inputs(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    q, d = rounded_inputs(x)
    x_hat = q * d.repeat_interleave(BLOCK, dim=1)
    w = w.double()
    extra = 0 if bias is None else bias.double()
    ref = x_hat @ w.T + extra
    scale = x_hat.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    tolerance = scale * (1e-5 if out.dtype == torch.float32 else 2**-8) + 1e-6
    assert ((out.double() - ref).abs() <= tolerance).all()
    # The rounding's own bound against the inputs as given: |x - d q| <= d / 2 an input.
    exact = x.double() @ w.T + extra
    bound = (d.repeat_interleave(BLOCK, dim=1) / 2) @ w.abs().T
    assert ((out.double() - exact).abs() <= bound + tolerance).all()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 96), (1000, 576), (16, 32)])
def test_every_tile_gives_the_product_of_the_rounded_inputs(
    kernels: Kernels, kind: str, n: int, k: int
) -> None:
    weight = KINDS[kind](n, k)
    values = weight.dequantize(torch.float32)
    linear = int8_linear(kernels, weight, None, torch.bfloat16)
    # one row streams the codes; more rows run tiles of 4 over each set of groups' quads, and 1-3 left
    for rows in (1, 2, 3, 4, 5, 8, 13, 33):
        x = (torch.randn(rows, k) * torch.rand(rows, k) * 4).to(torch.bfloat16)
        assert_is_the_product_of_the_rounded_inputs(linear(x), x, values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", list(KINDS))
def test_with_a_bias_and_float32_inputs(kernels: Kernels, dtype: torch.dtype, kind: str) -> None:
    n, k = 72, 160
    weight = KINDS[kind](n, k)
    bias = torch.randn(n).to(dtype)
    linear = int8_linear(kernels, weight, bias, dtype)
    values = weight.dequantize(torch.float32)
    for rows in (1, 3, 7):
        x = torch.randn(rows, k).to(dtype)
        assert_is_the_product_of_the_rounded_inputs(linear(x), x, values, bias)
    assert_is_the_product_of_the_rounded_inputs(linear(x, with_bias=False), x, values)
    # A block of zeros (d = 0) contributes nothing, and a row of them is the bias alone.
    x = torch.zeros(2, k, dtype=dtype)
    x[1, BLOCK:] = 1.0
    assert_is_the_product_of_the_rounded_inputs(linear(x), x, values, bias)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kind", list(KINDS))
# 13 groups of 16 (sets of 3, a remainder, a partial group): past 8 rows the threads share the rows'
# rounding; 65 groups: each thread rounds every row itself (16 groups a thread or more)
@pytest.mark.parametrize("n", [200, 1040])
def test_a_rows_bits_do_not_depend_on_the_rows_or_threads_beside_it(
    kernels: Kernels, kind: str, threads: int, n: int
) -> None:
    # Speculative decoding's exactness within the mode: a verification step's rows get the bits
    # single steps give them.
    k = 128
    linear = int8_linear(kernels, KINDS[kind](n, k, seed=1), None, torch.bfloat16)
    x = torch.randn(21, k).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = linear(x)
        alone = torch.cat([linear(x[i : i + 1].contiguous()) for i in range(x.shape[0])])
        parts = {(b, e): linear(x[b:e].contiguous()) for b, e in ((0, 2), (1, 4), (3, 8), (2, 9), (4, 21))}
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    for (begin, end), part in parts.items():
        assert torch.equal(together[begin:end], part), (begin, end)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_build_gives_the_same_bits(kind: str) -> None:
    """The integer sums are exact and the scaling runs the same fp32 operations everywhere: the VNNI
    build's tiles and the portable kernel agree bit for bit."""
    weight = KINDS[kind](100, 192, seed=3)
    x = torch.randn(9, 192).to(torch.bfloat16)
    bias = torch.randn(100).to(torch.bfloat16)
    results = {}
    for level in isa.runnable_levels(isa.this_cpu()):
        results[level.name] = int8_linear(load(level), weight, bias, torch.bfloat16)(x)
    first, *others = results
    for name in others:
        assert torch.equal(results[name], results[first]), (name, first)


def test_prefill_chunks_round_their_inputs_too(kernels: Kernels) -> None:
    # The mode has no dense path: from dense_rows on, a call is the same int8 product (faster than
    # the weights' bf16 rounding through the bf16 kernel), so a prompt's rows are a decode row's bits.
    weight = KINDS["q4_1"](96, 64, seed=2)
    values = weight.dequantize(torch.float32)
    with_dense_rows = int8_linear(kernels, weight, None, torch.bfloat16, dense_rows=9)
    x = torch.randn(40, 64).to(torch.bfloat16)
    together = with_dense_rows(x)
    assert_is_the_product_of_the_rounded_inputs(together, x, values)
    assert torch.equal(together, int8_linear(kernels, weight, None, torch.bfloat16)(x))
    assert torch.equal(together[3:4], with_dense_rows(x[3:4].contiguous()))
