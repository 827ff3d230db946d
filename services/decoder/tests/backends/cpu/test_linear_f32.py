"""The C float32 linear (csrc/linear_f32.c): each row within float32's error of the fp64 product, and the
same bits alone as among any rows, at every build level this machine runs (the `kernels` fixture).

MKL's float32 GEMM, which F.linear calls, gives a row other last bits among 1, 2, 3 or 5 rows; a
speculative verification's rows must get a one-row step's bits, so this kernel sums each output in
one order whatever the row count or the tile that computes it.
"""

from __future__ import annotations

import pytest
import torch

from tandem.decoder.backends.cpu.linear import CLinear


def assert_within_float32_error(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """|actual - exact| <= (k + 2) * 2^-24 * sum |x_i w_i| (+ |bias|): a float32 sum of k products in
    any order, with or without FMA, stays within that; a wrong element or a lost term does not."""
    exact = x.double() @ weight.double().T  # [rows, out_features]
    scale = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    bound = (weight.shape[1] + 2) * 2.0**-24 * scale + 1e-30
    assert actual.dtype == torch.float32 and actual.shape == exact.shape
    assert ((actual.double() - exact).abs() <= bound).all()


# Rows: 1-3 (a decode step of few sequences) have tiles of their own, 4 and more groups of 4 plus 1-3
# left over (5, 9: verifications of k = 4 and 8), 300 rows of 1,000 columns several row blocks (a
# sample of 300 rows is compared alone).
# Output features: a whole block of 24 weight rows, a partial one, several with a partial last, and
# more than one thread's share. Columns: whole chunks of 16 (and of 8), a tail, fewer than one chunk;
# 8,192 (a 1B model's down projection) is wide enough that row blocks are their floor of 64 rows.
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(96, 64), (50, 37), (7, 1000), (25, 5), (131, 48), (40, 8192)]
)
def test_each_row_is_the_product_and_the_same_bits_as_the_row_alone(
    kernels, out_features: int, in_features: int
) -> None:
    torch.manual_seed(in_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    linear = CLinear(kernels, weight, bias)
    for rows in (1, 2, 3, 4, 5, 7, 9, 33, 300):
        x = torch.randn(rows, in_features)
        together = linear(x)
        assert_within_float32_error(together, x, weight, bias)
        for i in sorted({*range(0, rows, max(1, rows // 12)), rows - 1}):  # every row of a small call
            assert torch.equal(together[i : i + 1], linear(x[i : i + 1].contiguous())), (rows, i)


def test_the_bias_can_be_left_out_for_row_parallel_sums(kernels) -> None:
    weight, bias = torch.randn(24, 32), torch.randn(24)
    x = torch.randn(3, 32)
    linear = CLinear(kernels, weight, bias)
    assert_within_float32_error(linear(x, with_bias=False), x, weight, None)
    assert torch.equal(linear(x, with_bias=False) + bias, linear(x))  # the bias is added last


def test_the_weight_is_read_in_place_and_inputs_it_cannot_read_are_refused(kernels) -> None:
    weight = torch.randn(8, 16)
    linear = CLinear(kernels, weight, None)
    assert linear.kernel_weight.data.data_ptr() == weight.data_ptr()  # no copy of a float32 weight
    assert linear(torch.empty(0, 16)).shape == (0, 8)
    with pytest.raises(ValueError, match=r"^x must be a contiguous float32 CPU tensor of shape \[\*, 16\]"):
        linear(torch.randn(2, 16).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"^bias must be a contiguous float32 CPU tensor of shape \[8\]"):
        CLinear(kernels, weight, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^tile_rows needs a bf16 weight"):
        CLinear(kernels, weight, None, tile_rows=1)
