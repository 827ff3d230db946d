"""The AMX tile linear (csrc/linear_tiles.c): against the fp64 product rounded once, a row's bits
whatever rows and threads share the call, and the descriptor's tile_rows deciding which calls tile.

Two builds run these tests: the amx level itself, only on a CPU with `amx_tile` and `amx_bf16` whose
kernel grants the tile state (elsewhere they skip, saying which is missing), and everywhere the
avx512bf16 level built with `tile_emulation.h`, which runs the same kernel source with each tile
instruction done in C and every shape the hardware would fault on checked: the tiling, padding and
tails are tested on every AVX512-BF16 machine, the hardware's own sums on an AMX one.
"""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from tandem.decoder.backends.cpu.build import X86_64_LEVELS
from tandem.decoder.backends.cpu.isa import this_cpu
from tandem.decoder.backends.cpu.kernels import Kernels, load
from tandem.decoder.backends.cpu.linear import CLinear

from .conftest import amx_kernels, emulated_tile_products
from .test_linear import rounded_once

LEVELS = {level.name: level for level in X86_64_LEVELS}


def assert_within_fp32_sums(
    actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """actual is the fp64 product rounded once to bf16, give or take one bf16 step and what fp32 sums
    of k products may lose in any order (k * 2^-24 of the sum of their magnitudes): a result near
    zero from large products cancelling is still checked, by the bound it has."""
    expected = rounded_once(x, weight, bias).double()
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = expected.abs() * 2**-7 + magnitude * x.shape[1] * 2**-24 + 1e-30
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert ((actual.double() - expected).abs() <= bound).all()


@pytest.fixture(scope="module", params=["amx", "emulated"])
def tiles(request: pytest.FixtureRequest) -> Kernels:
    """A build whose packed bf16 weights can run on tiles."""
    if request.param == "amx":
        return amx_kernels({"amx_tile", "amx_bf16", "avx512_bf16"})
    return request.getfixturevalue("emulated_tiles")


# Rows: one short row tile, one whole, whole + short, several. Shapes: a whole group of 96 features
# with k two whole K steps of 16 pairs, an odd k (its last pair half zero) under one step, a partial
# second group, k of 500 pairs (31 whole steps and a 4-pair tail), n under one C tile, and 200 x 600
# (a partial group, 18 whole steps and a 12-pair tail).
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(96, 64), (50, 37), (131, 48), (7, 1000), (200, 600)]
)
def test_tiles_equal_the_product_rounded_once(
    tiles: Kernels, rows: int, out_features: int, in_features: int
) -> None:
    torch.manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    linear = CLinear(tiles, weight, bias, tile_rows=1)
    assert_within_fp32_sums(linear(x), x, weight, bias)
    assert_within_fp32_sums(linear(x, with_bias=False), x, weight, None)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_bits_do_not_depend_on_the_rows_or_threads_beside_it(tiles: Kernels, threads: int) -> None:
    """Each output walks K in the same tile steps for any row count (short row tiles padded with
    zeros), and threads split whole groups: a row alone and among 39 others is the same bits."""
    torch.manual_seed(threads)
    linear = CLinear(tiles, torch.randn(300, 200).to(torch.bfloat16), torch.randn(300).to(torch.bfloat16), 1)
    x = torch.randn(40, 200).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = linear(x)
        alone = torch.cat([linear(x[i : i + 1].contiguous()) for i in range(40)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)


def test_calls_below_tile_rows_keep_the_packed_kernel(tiles: Kernels) -> None:
    """tile_rows is where tiles start: fewer rows run VDPBF16PS (linear_packed.c) on the same packed
    copy, as many or more run the tiles, as a weight bound with tile_rows 0 or 1 does (the emulation
    also counts the tile products, since both kernels may give the same bits)."""
    torch.manual_seed(1)
    weight, bias = torch.randn(131, 600).to(torch.bfloat16), torch.randn(131).to(torch.bfloat16)
    never, always, from_four = (CLinear(tiles, weight, bias, tile_rows=n) for n in (0, 1, 4))
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 600).to(torch.bfloat16)
        before = emulated_tile_products(tiles)
        result = from_four(x)
        if before is not None:
            assert (emulated_tile_products(tiles) > before) == (rows >= 4), rows
        assert torch.equal(result, (always if rows >= 4 else never)(x)), rows


def test_tile_rows_are_refused_where_the_build_has_no_tiles(kernels: Kernels) -> None:
    if kernels.tiles:
        pytest.skip("this build runs tiles")
    with pytest.raises(ValueError, match=f"^tile_rows needs AMX tiles, which the {kernels.level.name} build"):
        CLinear(kernels, torch.randn(8, 16).to(torch.bfloat16), None, tile_rows=1)


def test_an_amx_build_without_the_tile_state_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A kernel that refuses the tile state (a small sigaltstack, a kernel without AMX support) leaves
    the amx build on its vector kernels: one warning says so, where it was silent. Here the avx512bf16
    library, which has no tiles to grant, stands in for such an amx build."""
    if "avx512_bf16" not in this_cpu().flags:
        pytest.skip("needs a CPU that runs the avx512bf16 build")
    library = load(LEVELS["avx512bf16"])
    with caplog.at_level(logging.WARNING):
        refused = Kernels(ctypes.CDLL(str(library.path)), LEVELS["amx"], library.path)
    assert not refused.tiles
    assert "refused this process the AMX tile state" in caplog.text
