"""Int8 activations on AMX-INT8 tiles (csrc/linear_int8.c's tile path, the amx build): one tile product
(TDPBSSD, or TDPBSUD for Q4_1) does a block's integer sums for 16 rows at once, and each block is
then scaled by the vector kernel's own fp32 operations, so a call on tiles gives exactly the VPDPBUSD
kernel's bits, row for row, whatever rows and threads share it; the descriptor's tile_rows decides
which calls tile, and a call's whole tiles of 16 rows run on them (its last rows on VPDPBUSD).

Two builds run these tests, as for the bf16 tiles (test_linear_tiles.py): the amx level on a CPU with
`amx_tile` and `amx_int8` whose kernel grants the tile state (elsewhere it skips, saying which is
missing), and everywhere the avx512bf16 level built with `tile_emulation.h` (TDPBSUD in C, every tile
shape the hardware would fault on checked).
"""

from __future__ import annotations

import pytest
import torch

from services.decoder.tests.backends.cpu.test_linear_int8 import assert_is_the_product_of_the_rounded_inputs
from services.decoder.tests.backends.cpu.test_linear_quant import KINDS
from tandem.decoder.backends.cpu.build import X86_64_LEVELS
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.backends.cpu.linear import QuantLinear

from .conftest import amx_kernels, emulated_tile_products

LEVELS = {level.name: level for level in X86_64_LEVELS}


@pytest.fixture(scope="module", params=["amx", "emulated"])
def tiles(request: pytest.FixtureRequest) -> Kernels:
    """A build whose int8-activation linears can run on tiles."""
    if request.param == "amx":
        return amx_kernels({"amx_tile", "amx_int8", "avx512_vnni"})
    return request.getfixturevalue("emulated_tiles")


def int8_linear(
    kernels: Kernels, kind: str, n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype, tile_rows: int
) -> QuantLinear:
    codes = KINDS[kind](n, k, seed=n + k)
    weight = kernels.quantized_weight(codes, int8_activations=True, tile_rows=tile_rows)
    return QuantLinear(kernels, weight, bias, dtype)


# Rows: one short row tile, one whole, whole + short, several. Shapes: one group and one block, an odd
# number of blocks (the last C tile without a partner) and a partial last group, SmolLM2's q/k/v input
# against a few groups, many blocks.
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 96), (72, 576), (24, 1536)])
def test_tiles_give_the_vector_kernels_bits(tiles: Kernels, kind: str, n: int, k: int) -> None:
    bias = torch.randn(n).to(torch.bfloat16)
    tiled = int8_linear(tiles, kind, n, k, bias, torch.bfloat16, tile_rows=1)
    vector = int8_linear(tiles, kind, n, k, bias, torch.bfloat16, tile_rows=0)
    weight = KINDS[kind](n, k, seed=n + k).dequantize(torch.float32)
    for rows in (1, 5, 16, 17, 40):
        x = (torch.randn(rows, k) * torch.rand(rows, k) * 4).to(torch.bfloat16)
        before = emulated_tile_products(tiles)
        out = tiled(x)
        if before is not None:  # the tiles ran for every whole tile of 16 rows
            assert (emulated_tile_products(tiles) > before) == (rows >= 16), rows
        assert torch.equal(out, vector(x)), (rows, kind)
        assert_is_the_product_of_the_rounded_inputs(out, x, weight, bias)


@pytest.mark.parametrize("kind", list(KINDS))
def test_float32_inputs_and_no_bias(tiles: Kernels, kind: str) -> None:
    n, k = 50, 160
    tiled = int8_linear(tiles, kind, n, k, None, torch.float32, tile_rows=1)
    vector = int8_linear(tiles, kind, n, k, None, torch.float32, tile_rows=0)
    x = torch.randn(19, k)
    x[3] = 0.0  # a row of zeros: every block's scale 0
    x[7, : k // 2] = 0.0
    assert torch.equal(tiled(x), vector(x))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_bits_do_not_depend_on_the_rows_or_threads_beside_it(tiles: Kernels, threads: int) -> None:
    # A short last row tile is padded with zero rows, never re-tiled: a verification step's rows get
    # the bits single steps give them.
    linear = int8_linear(tiles, "q4_1", 200, 128, None, torch.bfloat16, tile_rows=1)
    x = torch.randn(37, 128).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = linear(x)
        alone = torch.cat([linear(x[i : i + 1].contiguous()) for i in range(x.shape[0])])
        part = linear(x[5:22].contiguous())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    assert torch.equal(together[5:22], part)


def test_calls_below_tile_rows_keep_the_vector_kernel(tiles: Kernels) -> None:
    """tile_rows is where tiles start: fewer rows run VPDPBUSD (the same bits, so the emulation's count
    of tile products tells which ran), and so does any call of fewer than 16 rows."""
    from_twenty = int8_linear(tiles, "q8_0", 48, 64, None, torch.bfloat16, tile_rows=20)
    from_one = int8_linear(tiles, "q8_0", 48, 64, None, torch.bfloat16, tile_rows=1)
    cases = [(from_twenty, 16, False), (from_twenty, 19, False), (from_twenty, 20, True)]
    cases += [(from_twenty, 40, True), (from_one, 15, False), (from_one, 16, True)]
    for linear, rows, tiled in cases:
        x = torch.randn(rows, 64).to(torch.bfloat16)
        before = emulated_tile_products(tiles)
        linear(x)
        if before is not None:
            assert (emulated_tile_products(tiles) > before) == tiled, rows


def test_tile_rows_are_refused_without_int8_activations_or_tiles(kernels: Kernels) -> None:
    weight = KINDS["q4_0"](16, 32)
    with pytest.raises(ValueError, match="^tile_rows of a quantized weight needs int8_activations"):
        kernels.quantized_weight(weight, tile_rows=1)
    with pytest.raises(ValueError, match="tile_rows must be"):
        kernels.quantized_weight(weight, int8_activations=True, tile_rows=-1)
    if kernels.tiles:
        return
    with pytest.raises(ValueError, match=f"^tile_rows needs AMX tiles, which the {kernels.level.name} build"):
        kernels.quantized_weight(weight, int8_activations=True, tile_rows=1)
