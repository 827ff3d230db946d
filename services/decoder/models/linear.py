"""Linear layers whose weights can be pre-packed once for oneDNN on CPU.

F.linear on CPU reorders the weight into oneDNN's blocked layout on every call; doing it once at
load time makes bf16 decode steps about 10-15% faster on bench-small (docs/PERFORMANCE.md). The
packed copy gives bit-identical results, so packing is an optimisation the loader applies, never a
different model. Packing is only for bf16 weights on a CPU with oneDNN: elsewhere the plain path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
) -> torch.Tensor:  # [num_tokens, out_features]
    if packed_weight is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear plus `prepack()`, and a forward that can leave the bias out (row-parallel sums)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None = None  # not a buffer: derived, never saved

    def prepack(self) -> None:
        if can_prepack(self.weight):
            self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return linear(x, self.weight, self.bias if with_bias else None, self.packed_weight)
