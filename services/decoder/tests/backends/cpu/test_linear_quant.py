"""Quantized linears (csrc/linear_quant.c): codes widened in registers or a thread's scratch.

Each output is, per block of 32 inputs, d (x . q) + m (sum of x) in fp32, rounded once: against the
float64 product with the file's values it is within fp32 summation error (float32 inputs) or one bf16
rounding (bf16), on every build and every tile, and every row's sums run in one order whatever rows
share the call. From a weight's `dense_rows` on (prefill steps), a bf16 call is instead the packed
bf16 kernel's product with each weight rounded to bf16.
"""

from __future__ import annotations

import pytest
import torch

from tandem.common.torch_part.quantized_tensor import BLOCK as QUANT_BLOCK
from tandem.common.torch_part.quantized_tensor import pack
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.backends.cpu.linear import CLinear, QuantLinear


def q4_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 and fp16 scales and offsets of GGUF's Q4_1 range (without m: Q4_0)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // QUANT_BLOCK, generator=g) * 0.02 + 1e-3).half()
    m = (-8 * d.float() + torch.randn(n, k // QUANT_BLOCK, generator=g) * 1e-3).half()
    return codes, d, m


KINDS = {
    "q4_0": lambda n, k, seed=0: pack(*q4_weight(n, k, seed)[:2]),
    "q4_1": lambda n, k, seed=0: pack(*q4_weight(n, k, seed)),
    "q8_0": lambda n, k, seed=0: pack(*q8_weight(n, k, seed)),
}


def q8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // QUANT_BLOCK, generator=g) * 0.002 + 1e-4).half()
    return codes, d


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    """w: the fp32 weight values, which the kernels multiply unrounded (d (x . q) + m (sum x))."""
    w = w.double()
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ w.abs().T) + (0 if bias is None else bias.double().abs())
    tolerance = scale * (1e-5 if out.dtype == torch.float32 else 2**-8) + 1e-6
    assert ((out.double() - ref).abs() <= tolerance).all()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 96), (1000, 576), (16, 32)])
def test_every_tile_gives_the_product_with_the_files_values(
    kernels: Kernels, kind: str, n: int, k: int
) -> None:
    weight = KINDS[kind](n, k)
    values = weight.dequantize(torch.float32)
    linear = QuantLinear(kernels, kernels.quantized_weight(weight), None, torch.bfloat16)
    # 1-4 rows: tiles widening as they go; 5-8: one tile of every row; 9-16: passes of 8; past 16:
    # the codes widened once into scratch
    for rows in (1, 2, 3, 4, 5, 8, 9, 13, 17, 33):
        x = torch.randn(rows, k).to(torch.bfloat16)
        assert_close_to_reference(linear(x), x, values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_quantized_linear_is_the_product_with_its_values(
    kernels: Kernels, dtype: torch.dtype, kind: str
) -> None:
    n, k = 72, 160
    weight = KINDS[kind](n, k)
    bias = torch.randn(n).to(dtype)
    linear = QuantLinear(kernels, kernels.quantized_weight(weight), bias, dtype)
    values = weight.dequantize(torch.float32)
    for rows in (1, 3, 7):
        x = torch.randn(rows, k).to(dtype)
        assert_close_to_reference(linear(x), x, values, bias)
    assert_close_to_reference(linear(x, with_bias=False), x, values)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels: Kernels, kind: str) -> None:
    # Speculative decoding's exactness: a verification step's rows get the bits single steps give them.
    n, k = 200, 128  # 13 groups of 16: whole tiles of 6 and 3 groups, a remainder, a partial group of 96
    linear = QuantLinear(kernels, kernels.quantized_weight(KINDS[kind](n, k, seed=1)), None, torch.bfloat16)
    x = torch.randn(20, k).to(torch.bfloat16)  # past 16 rows: widened once; alone: widened per tile
    together = linear(x)
    for i in range(x.shape[0]):
        assert torch.equal(together[i : i + 1], linear(x[i : i + 1].contiguous())), i
    # 2-4 rows, 5-8 (one tile of every row), 9-16 (passes of 8)
    for begin, end in ((0, 2), (1, 4), (3, 8), (2, 9), (3, 11), (1, 13), (4, 20)):
        assert torch.equal(together[begin:end], linear(x[begin:end].contiguous())), (begin, end)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("n", "k"), [(200, 128), (96, 64), (1000, 576)])
def test_from_dense_rows_on_a_call_is_the_bf16_kernels_product_with_the_rounded_weight(
    kernels: Kernels, kind: str, n: int, k: int
) -> None:
    # A prefill's rows: each weight dequantized as GGUF computes it and rounded once to bf16 (what the
    # checkpoint's bf16 import holds), through the packed bf16 kernel: the dense model's bits exactly.
    # Below dense_rows, and on builds without the packed kernel, the exact per-block sums as ever.
    weight = KINDS[kind](n, k, seed=2)
    bias = torch.randn(n).to(torch.bfloat16)
    dense_from = 9
    linear = QuantLinear(kernels, kernels.quantized_weight(weight, dense_from), bias, torch.bfloat16)
    exact = QuantLinear(kernels, kernels.quantized_weight(weight), bias, torch.bfloat16)
    rounded = CLinear(kernels, weight.dequantize(torch.bfloat16), bias)
    for rows in (1, 4, 8, 9, 13, 40):
        x = torch.randn(rows, k).to(torch.bfloat16)
        if rows >= dense_from and kernels.weight_layout != 0:
            assert torch.equal(linear(x), rounded(x)), rows
        else:
            assert torch.equal(linear(x), exact(x)), rows
    # A dense call's rows do not depend on each other either.
    x = torch.randn(24, k).to(torch.bfloat16)
    together = linear(x)
    assert torch.equal(together[5:17], linear(x[5:17].contiguous()))


def test_inputs_the_kernel_cannot_read_are_refused_naming_the_argument(kernels: Kernels) -> None:
    weight = kernels.quantized_weight(KINDS["q4_1"](16, 64))
    linear = QuantLinear(kernels, weight, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be a contiguous bfloat16 CPU tensor of shape \[\*, 64\]"):
        linear(torch.randn(2, 64))
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        QuantLinear(kernels, weight, torch.zeros(15, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or float32 inputs"):
        QuantLinear(kernels, weight, None, torch.float16)
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 16)
