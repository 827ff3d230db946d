"""Quantized linears (csrc/linear_quant.c): w = d q + m per block of 32 inputs, never dequantized.

Each output is sum over blocks of d (x . q) + m (sum of x) in fp32, rounded once: against the float64
product with the dequantized weight it is within fp32 summation error (float32 inputs) or one bf16
rounding (bf16). Every row's sums run in one order whatever rows share the call, on every build.
"""

from __future__ import annotations

import pytest
import torch

from tandem.decoder.backends.cpu.kernels import WEIGHT_Q4, WEIGHT_Q8, Kernels
from tandem.decoder.backends.cpu.linear import QuantLinear
from tandem.decoder.models.quantized import BLOCK as QUANT_BLOCK
from tandem.decoder.models.quantized import pack


def q4_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 and fp16 scales and offsets of GGUF's Q4_1 range."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // QUANT_BLOCK, generator=g) * 0.02 + 1e-3).half()
    m = (-8 * d.float() + torch.randn(n, k // QUANT_BLOCK, generator=g) * 1e-3).half()
    return codes, d, m


def q8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // QUANT_BLOCK, generator=g) * 0.002 + 1e-4).half()
    return codes, d


def dequantized(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """float64 [n, k]: d q + m, each scale repeated over its 32 inputs."""
    w = codes.double() * d.double().repeat_interleave(QUANT_BLOCK, dim=1)
    return w if m is None else w + m.double().repeat_interleave(QUANT_BLOCK, dim=1)


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    # fp32 sums of k products, then (bf16) one rounding: relative to the size of the terms.
    scale = (x.double().abs() @ w.abs().T) + (0 if bias is None else bias.double().abs())
    tolerance = scale * (1e-5 if out.dtype == torch.float32 else 2**-8) + 1e-6
    assert ((out.double() - ref).abs() <= tolerance).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 96), (1000, 576), (16, 32)])
def test_a_4_bit_linear_is_the_product_with_its_dequantized_weight(
    kernels: Kernels, dtype: torch.dtype, n: int, k: int
) -> None:
    codes, d, m = q4_weight(n, k)
    weight = kernels.quantized_weight(pack(codes, d, m))
    assert weight.format == WEIGHT_Q4
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, k).to(dtype)
        assert_close_to_reference(QuantLinear(kernels, weight, None, dtype)(x), x, dequantized(codes, d, m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_8_bit_linear_with_a_bias_is_the_product_with_its_dequantized_weight(
    kernels: Kernels, dtype: torch.dtype
) -> None:
    n, k = 72, 160
    codes, d = q8_weight(n, k)
    weight = kernels.quantized_weight(pack(codes, d, None))
    assert weight.format == WEIGHT_Q8
    bias = torch.randn(n).to(dtype)
    for rows in (1, 2, 5):
        x = torch.randn(rows, k).to(dtype)
        assert_close_to_reference(
            QuantLinear(kernels, weight, bias, dtype)(x), x, dequantized(codes, d, None), bias
        )
    no_bias = QuantLinear(kernels, weight, bias, dtype)(x, with_bias=False)
    assert_close_to_reference(no_bias, x, dequantized(codes, d, None))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels: Kernels, bits: int) -> None:
    # Speculative decoding's exactness: a verification step's rows get the bits single steps give them.
    n, k = 200, 128  # 13 groups of 16: whole tiles of 6 and 3 groups, and a remainder
    if bits == 4:
        codes, d, m = q4_weight(n, k, seed=1)
        weight = kernels.quantized_weight(pack(codes, d, m))
    else:
        codes, d = q8_weight(n, k, seed=1)
        weight = kernels.quantized_weight(pack(codes, d, None))
    linear = QuantLinear(kernels, weight, None, torch.bfloat16)
    x = torch.randn(11, k).to(torch.bfloat16)  # tiles of 4 rows, then 3
    together = linear(x)
    for i in range(x.shape[0]):
        assert torch.equal(together[i : i + 1], linear(x[i : i + 1].contiguous())), i
    for begin, end in ((0, 2), (1, 4), (3, 8)):
        assert torch.equal(together[begin:end], linear(x[begin:end].contiguous())), (begin, end)


def test_inputs_the_kernel_cannot_read_are_refused_naming_the_argument(kernels: Kernels) -> None:
    codes, d, m = q4_weight(16, 64)
    weight = kernels.quantized_weight(pack(codes, d, m))
    linear = QuantLinear(kernels, weight, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be a contiguous bfloat16 CPU tensor of shape \[\*, 64\]"):
        linear(torch.randn(2, 64))
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        QuantLinear(kernels, weight, torch.zeros(15, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or float32 inputs"):
        QuantLinear(kernels, weight, None, torch.float16)
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 16)
