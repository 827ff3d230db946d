"""Linear layers whose bf16 weights run on the fastest CPU path the machine has.

- oneDNN with a bf16 path (AVX-512 or AVX-NE-CONVERT): F.linear reorders the weight into oneDNN's
  blocked layout on every call; doing it once at load time makes bf16 decode steps about 10-15%
  faster on bench-small (docs/PERFORMANCE.md). The packed copy gives bit-identical results.
- without one (AVX2 only): torch's bf16 matmul is a reference loop, so the weight is bound to the C
  kernel instead (`native_linear.py`; attached by DecoderModel.use_native_kernels).
Both are optimisations the loader applies, never a different model; elsewhere F.linear runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.decoder.models.native_linear import NativeLinear


def can_prepack(weight: torch.Tensor) -> bool:
    """bf16 on a CPU whose oneDNN has a bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT).

    On an AVX2-only CPU the reorder raises; F.linear then stays the only path.
    """
    is_cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
    return is_cpu_bf16 and torch.backends.mkldnn.is_available() and _has_onednn_bf16()


def _has_onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] -> oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
    packed_weight: torch.Tensor | None = None,  # pack_weight(weight), when packed
    native: NativeLinear | None = None,  # weight (and bias) bound to the C kernel, when bound
) -> torch.Tensor:  # [num_tokens, out_features]
    if packed_weight is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    if native is not None and native.accepts(x):
        return native(x, with_bias=bias is not None)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear plus `prepack()` and the C kernel, and a forward that can leave the bias out (row-parallel
    sums)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None = None  # not a buffer: derived, never saved
        self.native: NativeLinear | None = None  # set by DecoderModel.use_native_kernels

    def prepack(self) -> None:
        if can_prepack(self.weight):
            self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return linear(x, self.weight, self.bias if with_bias else None, self.packed_weight, self.native)
