"""Quantized weights: 4- or 8-bit codes with an fp16 scale (and an fp16 offset) per 32 inputs.

A weight [n, k] has, for the block of 32 inputs holding i, w[f][i] = d (q - 8) (4-bit without
offsets: GGUF's Q4_0), d q + m (4-bit with offsets: Q4_1), or d q (8-bit: Q8_0), each computed in
fp32 as GGUF's own dequantization computes it (a product, then a sum), so the values are the file's.
The decoder keeps its weights in this form and nowhere dequantized (decoder/models/quantized.py has
the modules; decoder/backends/cpu/csrc/linear_quant.c reads the same tensors in place); the encoder
rounds its lookup table through it, so its rows are the decoder's quantized embedding's.

Storage (`pack`): outputs in groups of 16 (the last padded with zeros), for each group the blocks in
order, for each block its 16 pairs of inputs, for each pair the group's 32 codes in lane order
L = 2 c + t (output c, input 2 p + t):
  4-bit codes  [group][block][pair][16] uint8: byte j holds lane j (low nibble) and lane j + 16
  8-bit codes  [group][block][pair][32] int8, lane by lane
  scales, mins [group][block][output] float16
so that one pair of 16 outputs is 16 (or 32) consecutive bytes, one vector load in the kernel, whose
two halves become, once widened, the 16 dwords of (w[c][2p], w[c][2p + 1]) a bf16 dot product takes.

Rounding a dense weight (`quantize`, for --quantization int8 / int4) picks its scales per group of
inputs, a whole number of blocks (a whole row: per output channel); every block of a group stores
the group's scale, so the kernels are the same whatever the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32  # inputs per scale
GROUP = 16  # outputs per group of the storage layout


@dataclass(frozen=True)
class QuantizedTensor:
    """A [n, k] weight as `pack` stores it (see the module docstring)."""

    bits: int  # 4 or 8
    n: int
    k: int
    # 1-D as `pack` stores them; several XLA devices hold the same bytes viewed [groups, blocks, -1]
    # (decoder/backends/xla/sharding.py), which every method below reads alike.
    codes: torch.Tensor  # uint8 (4-bit: two codes a byte) or int8
    scales: torch.Tensor  # float16: d
    mins: torch.Tensor | None  # float16: m; 4-bit with offsets only

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes [n, k] one a byte, d [n, k / 32], m [n, k / 32] or None): `pack`'s inverse."""
        groups, blocks = -(-self.n // GROUP), self.k // BLOCK
        lanes = self._lanes(self.codes.view(groups, blocks, BLOCK // 2, -1))  # [g, b, pair, 16 out, 2]
        codes = lanes.permute(0, 3, 1, 2, 4).reshape(groups * GROUP, self.k)[: self.n]

        def per_output(t: torch.Tensor) -> torch.Tensor:
            return t.view(groups, blocks, GROUP).permute(0, 2, 1).reshape(groups * GROUP, blocks)[: self.n]

        return codes, per_output(self.scales), None if self.mins is None else per_output(self.mins)

    def _lanes(self, stored: torch.Tensor) -> torch.Tensor:
        """[..., 16 outputs, 2] codes of stored pairs [..., 16 bytes (4-bit) or 32 int8]."""
        if self.bits == 4:
            stored = torch.cat((stored & 15, stored >> 4), dim=-1)  # lanes 0-15, then 16-31
        return stored.unflatten(-1, (GROUP, 2))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[n, k] in `dtype`: each weight in fp32 as GGUF computes it, then rounded once."""
        codes, d, m = self.unpack()
        return _values(self.bits, codes, d, m).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` ([num_ids], int) of the dequantized weight: [num_ids, k] in `dtype`."""
        groups, blocks = -(-self.n // GROUP), self.k // BLOCK
        g, c = ids // GROUP, ids % GROUP
        lanes = self._lanes(self.codes.view(groups, blocks, BLOCK // 2, -1)[g])  # [ids, b, pair, 16, 2]
        codes = lanes[torch.arange(len(ids), device=ids.device), :, :, c].reshape(-1, self.k)
        d = self.scales.view(groups, blocks, GROUP)[g, :, c]  # [ids, block]
        m = None if self.mins is None else self.mins.view(groups, blocks, GROUP)[g, :, c]
        return _values(self.bits, codes, d, m).to(dtype)


def _values(bits: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """fp32 [rows, k] of codes [rows, k] and per-block d, m [rows, k / 32], as GGUF computes them."""
    q = codes.float() - 8 if bits == 4 and m is None else codes.float()
    values = q * d.float().repeat_interleave(BLOCK, dim=1)
    return values if m is None else values + m.float().repeat_interleave(BLOCK, dim=1)


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> QuantizedTensor:
    """codes [n, k]: uint8 0..15 (4-bit: d (q - 8), or d q + m with offsets m) or int8 (8-bit: d q);
    d and m float16 [n, k / 32]."""
    n, k = codes.shape
    if k % BLOCK != 0 or n < 1:
        raise ValueError(f"a quantized weight needs whole blocks of {BLOCK} inputs per row, got [{n}, {k}]")
    bits = 4 if codes.dtype == torch.uint8 else 8
    if bits == 4 and int(codes.max()) > 15:
        raise ValueError("4-bit codes must be uint8 in 0..15")
    if bits == 8 and (codes.dtype != torch.int8 or m is not None):
        raise ValueError("8-bit codes must be int8, without offsets")
    groups, blocks = -(-n // GROUP), k // BLOCK
    padded = F.pad(codes, (0, 0, 0, groups * GROUP - n))  # [groups * 16, k]
    lanes = padded.view(groups, GROUP, blocks, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)  # [g, b, p, out, 2]
    lanes = lanes.reshape(groups, blocks, BLOCK // 2, 2 * GROUP)  # lane L = 2 out + t
    if bits == 4:
        packed = (lanes[..., :GROUP] | lanes[..., GROUP:] << 4).contiguous().view(-1)
    else:
        packed = lanes.contiguous().view(-1)

    def per_group(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t.to(torch.float16), (0, 0, 0, groups * GROUP - n))
        return t.view(groups, GROUP, blocks).permute(0, 2, 1).contiguous().view(-1)

    return QuantizedTensor(bits, n, k, packed, per_group(d), None if m is None else per_group(m))


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """The weights' rows one after another (q, k, v into qkv; gate, up into gate_up)."""
    if len({p.bits for p in parts}) != 1 or len({p.k for p in parts}) != 1:
        raise ValueError("weights fused into one must share their quantization and width")
    if len({p.mins is None for p in parts}) != 1:
        raise ValueError("weights fused into one must share their quantization (offsets or none)")
    unpacked = [p.unpack() for p in parts]
    mins = None if parts[0].mins is None else torch.cat([u[2] for u in unpacked])
    return pack(torch.cat([u[0] for u in unpacked]), torch.cat([u[1] for u in unpacked]), mins)


def quantize(weight: torch.Tensor, bits: int, group_size: int = BLOCK) -> QuantizedTensor:
    """A dense [n, k] weight rounded to `bits`, one scale per `group_size` inputs of a row (a multiple
    of 32 dividing k): 8-bit symmetric (d = max |w| / 127, as GGUF's Q8_0), 4-bit with an offset
    (d = (max - min) / 15, m = min, as Q4_1)."""
    n, k = weight.shape
    if group_size < BLOCK or group_size % BLOCK != 0:
        raise ValueError(f"a group is a whole number of blocks of {BLOCK} inputs, got {group_size}")
    if k % group_size != 0:
        raise ValueError(f"a row of {k} inputs is not a whole number of groups of {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    per_block = group_size // BLOCK

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [n, groups] -> [n, k / 32]: each block its group's
        return t.repeat_interleave(per_block, dim=1)

    if bits == 8:
        d = (w.abs().amax(dim=-1) / 127).half()  # [n, groups]
        inverse = torch.where(d.float() > 0, 1 / d.float(), 0.0)[..., None]
        codes = (w * inverse).round().clamp(-128, 127).to(torch.int8).view(n, k)
        return pack(codes, blocks(d), None)
    if bits == 4:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        d, m = ((high - low) / 15).half(), low.half()
        inverse = torch.where(d.float() > 0, 1 / d.float(), 0.0)[..., None]
        codes = ((w - m.float()[..., None]) * inverse).round().clamp(0, 15).to(torch.uint8).view(n, k)
        return pack(codes, blocks(d), blocks(m))
    raise ValueError(f"bits must be 4 or 8, got {bits}")


# --quantization of a dense checkpoint: the linears' bits, and whether a row has one scale (per output
# channel) or one per --quantization-group-size inputs. The token table, and the LM head it ties to, is
# 8-bit per output channel under either (`quantize_table`).
SCHEMES = {"int8": (8, "channel"), "int4": (4, "group")}


def quantize_scheme(weight: torch.Tensor, scheme: str, group_size: int) -> QuantizedTensor:
    """A linear's `weight` [n, k] rounded as --quantization `scheme` ("int8" or "int4") says."""
    bits, per = SCHEMES[scheme]
    return quantize(weight, bits, weight.shape[1] if per == "channel" else group_size)


def quantize_table(weight: torch.Tensor) -> QuantizedTensor:
    """The token table [vocab, hidden] (or an untied LM head) under --quantization int8 or int4: 8-bit,
    one scale per row. As llama.cpp's 4-bit files keep it (SmolLM2's Q4_1 file: Q8_0): at 4 bits the
    head alone raised SmolLM2's perplexity 7.6 %, at 8 it costs nothing measurable
    (bench/perplexity.py, docs/PERFORMANCE.md)."""
    return quantize(weight, 8, weight.shape[1])
