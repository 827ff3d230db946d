"""The bf16 linear kernel (models/linear_kernels.c) against fp32 products rounded once, and where it runs.

The kernel accumulates in fp32 and rounds once, as torch's bf16 linear does; only the order of the
fp32 sums differs, so a result is the fp32 product's rounding or, rarely, the bf16 value next to it.
"""

from __future__ import annotations

import pytest
import torch

from services.decoder.models.linear import Linear, can_prepack
from services.decoder.models.loader import load_model
from services.decoder.models.native_linear import NativeLinear

from .conftest import Checkpoint
from .helpers import greedy

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
# several with a partial last. Columns: whole chunks of 16, a tail, fewer than one chunk.
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
    actual = NativeLinear(kernels, weight, bias)(x)
    assert_within_one_rounding(actual, rounded_once(x, weight, bias))


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 8, 9, 17, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(131, 48), (50, 37), (30, 1000)])
def test_a_rows_result_is_the_same_bits_whatever_rows_share_the_call(
    kernels, rows: int, out_features: int, in_features: int
) -> None:
    """Speculative decoding verifies k proposals as k + 1 rows of one step and promises the tokens a
    step per row would give: every row's sums must run in one order whatever tile computes them."""
    torch.manual_seed(rows + out_features)
    linear = NativeLinear(
        kernels,
        torch.randn(out_features, in_features).to(torch.bfloat16),
        torch.randn(out_features).to(torch.bfloat16),
    )
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    together = linear(x)
    for i in range(rows):
        assert torch.equal(together[i : i + 1], linear(x[i : i + 1].contiguous())), i


def test_an_empty_batch_gives_an_empty_result(kernels) -> None:
    weight = torch.randn(8, 16).to(torch.bfloat16)
    assert NativeLinear(kernels, weight, None)(torch.empty(0, 16, dtype=torch.bfloat16)).shape == (0, 8)


def test_the_bias_can_be_left_out_for_row_parallel_sums(kernels) -> None:
    weight, bias = torch.randn(24, 32).to(torch.bfloat16), torch.randn(24).to(torch.bfloat16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert_within_one_rounding(
        NativeLinear(kernels, weight, bias)(x, with_bias=False), rounded_once(x, weight, None)
    )


def test_inputs_the_kernel_cannot_read_are_refused_naming_the_argument(kernels) -> None:
    weight = torch.randn(8, 16).to(torch.bfloat16)
    bound = NativeLinear(kernels, weight, None)
    for bad in (
        torch.randn(2, 16),  # float32
        torch.randn(2, 12).to(torch.bfloat16),  # wrong width
        torch.randn(16, 2).to(torch.bfloat16).T,  # not contiguous
        torch.randn(2, 2, 16).to(torch.bfloat16),  # not 2-D
    ):
        assert not bound.accepts(bad)
        with pytest.raises(
            ValueError, match=r"^x must be a contiguous bfloat16 CPU tensor of shape \[\*, 16\]"
        ):
            bound(bad)
    with pytest.raises(ValueError, match="^weight must be a contiguous 2-D bfloat16"):
        NativeLinear(kernels, weight.float(), None)
    with pytest.raises(ValueError, match=r"^bias must be a contiguous bfloat16 CPU tensor of shape \[8\]"):
        NativeLinear(kernels, weight, torch.zeros(9, dtype=torch.bfloat16))


def test_a_linear_layer_falls_back_to_torch_for_inputs_the_kernel_refuses(kernels) -> None:
    layer = Linear(16, 8).to(torch.bfloat16)
    layer.native = NativeLinear(kernels, layer.weight, layer.bias)
    x = torch.randn(5, 2, 16).to(torch.bfloat16)  # 3-D: F.linear's job
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(
    can_prepack(torch.zeros(1, dtype=torch.bfloat16)), reason="oneDNN packs bf16 weights here"
)
def test_use_native_kernels_binds_every_bf16_linear_and_the_tied_head_where_onednn_cannot(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    model.prepack()  # packs nothing on this CPU: oneDNN has no bf16 path
    model.use_native_kernels(kernels)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.native is not None for m in linears)
    assert model.native_head is not None
    model.use_native_kernels(None)
    assert all(m.native is None for m in linears) and model.native_head is None


def test_float32_models_keep_torch_linears(kernels, checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    model.use_native_kernels(kernels)
    assert all(m.native is None for m in model.modules() if isinstance(m, Linear))
    assert model.native_head is None


def test_bf16_greedy_tokens_on_the_linear_kernel_match_the_torch_linears(
    kernels, checkpoint: Checkpoint
) -> None:
    # The checkpoints' logits are far apart (initializer_range 0.1), so one-bit differences in the
    # projections cannot flip a greedy choice: the tokens must be the same.
    model = load_model(checkpoint.path, dtype="bfloat16").model
    expected = greedy(model, PROMPT, 16)
    for module in model.modules():  # the linears alone; the other kernels are tested on their own
        if isinstance(module, Linear):
            module.native = NativeLinear(kernels, module.weight, module.bias)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.native_head = NativeLinear(kernels, head, None)
    assert greedy(model, PROMPT, 16) == expected
