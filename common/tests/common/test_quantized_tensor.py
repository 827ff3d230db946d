"""Quantized weights' form (common/torch_part/quantized_tensor.py): the storage layout the CPU kernels read,
lookups of rows, and rounding a dense weight per block, per group or per output channel."""

from __future__ import annotations

import pytest
import torch

from tandem.common.torch_part.quantized_tensor import (
    BLOCK,
    SCHEMES,
    cat_rows,
    pack,
    quantize,
    quantize_scheme,
    quantize_table,
)


def q4(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // BLOCK, generator=g) * 0.02 + 1e-3).half()
    m = (torch.randn(n, k // BLOCK, generator=g) * 0.1).half()
    return codes, d, m


def q8(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return codes, (torch.rand(n, k // BLOCK, generator=g) * 0.002).half()


def lanes(codes: torch.Tensor, g: int, b: int, p: int) -> torch.Tensor:
    """The 32 codes of pair p of block b of group g in lane order 2 c + t (output c, input 2 p + t)."""
    pair = codes[16 * g : 16 * (g + 1), BLOCK * b + 2 * p : BLOCK * b + 2 * p + 2]  # [16, 2]
    return pair.reshape(-1)


def test_4_bit_storage_holds_a_pairs_32_lanes_in_16_bytes_low_nibbles_first() -> None:
    n, k = 20, 64  # two groups of 16 outputs (the second padded with zeros), two blocks
    codes, d, m = q4(n, k)
    weight = pack(codes, d, m)
    groups, blocks = 2, k // BLOCK
    padded = torch.zeros(groups * 16, k, dtype=torch.uint8)
    padded[:n] = codes
    stored = weight.codes.view(groups, blocks, BLOCK // 2, 16)  # [group, block, pair, byte]
    for g in range(groups):
        for b in range(blocks):
            for p in range(BLOCK // 2):
                lane = lanes(padded, g, b, p)
                assert torch.equal(stored[g, b, p], lane[:16] | lane[16:] << 4), (g, b, p)
    scales = weight.scales.view(groups, blocks, 16)
    assert torch.equal(scales[0], d[:16].T) and torch.equal(scales[1, :, :4], d[16:].T)
    assert not scales[1, :, 4:].any() and not weight.mins.view(groups, blocks, 16)[1, :, 4:].any()
    assert weight.nbytes == groups * 16 * (k // 2 + 2 * 2 * blocks)  # 0.625 bytes a weight


def test_8_bit_storage_holds_a_pairs_32_lanes_in_order() -> None:
    codes, d = q8(16, 32)
    stored = pack(codes, d).codes.view(1, 1, BLOCK // 2, 32)
    for p in range(BLOCK // 2):
        assert torch.equal(stored[0, 0, p], lanes(codes, 0, 0, p)), p


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_unpack_dequantize_and_rows_compute_each_value_as_gguf_does(kind: str) -> None:
    n, k = 37, 96
    codes, d, m = {"q4_0": q4(n, k)[:2] + (None,), "q4_1": q4(n, k), "q8_0": (*q8(n, k), None)}[kind]
    weight = pack(codes, d, m)
    unpacked = weight.unpack()
    assert torch.equal(unpacked[0], codes) and torch.equal(unpacked[1], d)
    assert (unpacked[2] is None) == (m is None) and (m is None or torch.equal(unpacked[2], m))
    q = codes.float() - 8 if kind == "q4_0" else codes.float()  # Q4_0 is d (q - 8)
    expected = q * d.float().repeat_interleave(BLOCK, 1)
    if m is not None:  # Q4_1: the product, then the offset
        expected = expected + m.float().repeat_interleave(BLOCK, 1)
    assert torch.equal(weight.dequantize(torch.float32), expected)
    ids = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(weight.rows(ids, torch.bfloat16), expected[ids].to(torch.bfloat16))


def test_rows_of_several_weights_concatenate_as_their_dense_forms_do() -> None:
    parts = [pack(*q4(n, 64, seed=n)) for n in (24, 8, 8)]
    fused = cat_rows(parts)
    assert fused.shape == (40, 64)
    assert torch.equal(
        fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts])
    )
    with pytest.raises(ValueError, match="share their quantization"):
        cat_rows([parts[0], pack(*q8(8, 64))])
    with pytest.raises(ValueError, match="offsets or none"):
        cat_rows([parts[0], pack(*q4(8, 64)[:2])])


@pytest.mark.parametrize("bits", [4, 8])
def test_rounding_a_dense_weight_errs_by_at_most_half_a_step_per_block(bits: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    weight = quantize(w, bits)
    assert weight.bits == bits
    _, d, _ = weight.unpack()
    step = d.float().repeat_interleave(BLOCK, 1)
    # fp16 scales round d itself: allow that rounding on top of half a step.
    error = (weight.dequantize(torch.float32) - w).abs()
    assert (error <= step * 0.5 + w.abs() * 2**-10 + 1e-6).all()


def test_weights_the_storage_cannot_hold_are_refused() -> None:
    codes, d, m = q4(16, 64)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        pack(codes[:, :48], d[:, :1], m[:, :1])
    with pytest.raises(ValueError, match="4-bit codes must be uint8 in 0..15"):
        pack(codes | 16, d, m)
    with pytest.raises(ValueError, match="8-bit codes must be int8, without offsets"):
        pack(codes.to(torch.int8), d, m)
    with pytest.raises(ValueError, match="a row of 40 inputs is not a whole number of groups of 32"):
        quantize(torch.randn(4, 40), 8)
    with pytest.raises(ValueError, match="a row of 96 inputs is not a whole number of groups of 64"):
        quantize(torch.randn(4, 96), 4, group_size=64)
    with pytest.raises(ValueError, match="a group is a whole number of blocks of 32 inputs, got 48"):
        quantize(torch.randn(4, 96), 4, group_size=48)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize(torch.randn(4, 64), 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_group_of_several_blocks_gives_each_of_its_blocks_the_groups_scale(bits: int) -> None:
    torch.manual_seed(1)
    w = torch.randn(20, 256)
    grouped = quantize(w, bits, group_size=128)
    _, d, m = grouped.unpack()  # [20, 8]: one per block of 32
    assert torch.equal(d[:, 0:4], d[:, 0:1].expand(-1, 4)) and torch.equal(d[:, 4:8], d[:, 4:5].expand(-1, 4))
    assert (m is None) == (bits == 8)
    # The same as rounding each group of 128 inputs as one block would be: its scale spans its range.
    rows = w.view(20, 2, 128)
    if bits == 8:
        assert torch.equal(d[:, ::4], (rows.abs().amax(-1) / 127).half())
    else:
        assert torch.equal(d[:, ::4], ((rows.amax(-1) - rows.amin(-1)) / 15).half())
        assert torch.equal(m[:, ::4], rows.amin(-1).half())
    # Coarser scales err more than the default block's, never by more than half their own step.
    error = (grouped.dequantize(torch.float32) - w).abs()
    step = d.float().repeat_interleave(BLOCK, 1)
    assert (error <= step * 0.5 + w.abs() * 2**-10 + 1e-6).all()
    assert error.mean() > (quantize(w, bits).dequantize(torch.float32) - w).abs().mean()


def test_int8_has_one_scale_per_output_channel_and_int4_one_per_group() -> None:
    torch.manual_seed(2)
    w = torch.randn(16, 192)
    _, d8, m8 = quantize_scheme(w, "int8", group_size=64).unpack()
    assert m8 is None and torch.equal(d8, d8[:, :1].expand(-1, 6))  # the group size is int4's only
    assert torch.equal(d8[:, 0], (w.abs().amax(-1) / 127).half())
    _, d4, m4 = quantize_scheme(w, "int4", group_size=64).unpack()
    assert m4 is not None and torch.equal(d4[:, 0:2], d4[:, 0:1].expand(-1, 2))
    assert not torch.equal(d4[:, 0], d4[:, 2])
    assert set(SCHEMES) == {"int8", "int4"}
    # The token table (and the head it ties to) is 8-bit per row under either scheme.
    table = quantize_table(w)
    assert (table.bits, table.mins) == (8, None) and torch.equal(
        table.scales, quantize_scheme(w, "int8", 32).scales
    )
