"""nn.Linear whose forward can leave the bias out: a row-parallel projection adds it once, after the sum.

Which kernel runs a linear on a given CPU (oneDNN's packed bf16, the C kernel) is the CPU executor's
choice (backends/cpu/linear.py); the model's own forward is F.linear.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Projection(Protocol):
    """What runs a projection: the module below, or a kernel a backend bound to its weight
    (models/kernels.py): [num_tokens, in_features] -> [num_tokens, out_features]."""

    bias: torch.Tensor | None  # [out_features]: a row-parallel projection adds it once, after the sum

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor: ...


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return F.linear(x, self.weight, self.bias if with_bias else None)
