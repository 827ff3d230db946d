"""A linear layer's bf16 weight bound to the C kernel `tandem_linear_bf16` (linear_kernels.c).

Used where oneDNN has no bf16 path (an AVX2-only CPU): there torch's bf16 matmul is a reference
loop, tens of times slower than the kernel. The weight (and bias) are checked once, when bound: a
decode step calls 120 linears on a 30-layer model, so a call checks only its input, in a handful
of attribute reads, and refuses (ValueError naming `x`) what the kernel cannot read in place.
"""

from __future__ import annotations

import torch

from services.decoder.models.native import NativeKernels


def can_bind(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: bf16, 2-D, contiguous, on the CPU, at least one column."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] >= 1
        and weight.is_contiguous()
    )


class NativeLinear:
    """x [num_tokens, in_features] bf16 -> x @ weight.T (+ bias) [num_tokens, out_features] bf16.

    fp32 accumulation and one rounding, like torch's bf16 linear; the sums run in another order, so
    a result may differ from torch's in its last bit.
    """

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if not can_bind(weight):
            raise ValueError(
                "weight must be a contiguous 2-D bfloat16 CPU tensor with at least one column, got "
                f"{weight.dtype} {list(weight.shape)} on {weight.device}"
            )
        out_features, in_features = weight.shape
        if bias is not None and not (
            bias.device.type == "cpu"
            and bias.dtype == torch.bfloat16
            and tuple(bias.shape) == (out_features,)
            and bias.is_contiguous()
        ):
            raise ValueError(
                f"bias must be a contiguous bfloat16 CPU tensor of shape [{out_features}] to match weight, "
                f"got {bias.dtype} {list(bias.shape)} on {bias.device}"
            )
        self._fn = kernels.linear_bf16
        # Held so the pointers below stay valid for as long as this object lives.
        self.weight = weight.detach()  # [out_features, in_features]
        self.bias = None if bias is None else bias.detach()  # [out_features]
        self.out_features, self.in_features = out_features, in_features
        self._weight_ptr = self.weight.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `x` can go to the kernel as it is (else the caller keeps F.linear)."""
        return (
            x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.shape[1] == self.in_features
            and x.device.type == "cpu"
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        if not self.accepts(x) or x.layout != torch.strided or x.is_neg():
            raise ValueError(
                f"x must be a contiguous bfloat16 CPU tensor of shape [*, {self.in_features}] to match "
                f"weight, got {x.dtype} {list(x.shape)} on {x.device}"
            )
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        status = self._fn(
            x.data_ptr(),
            self._weight_ptr,
            self._bias_ptr if with_bias else None,
            out.data_ptr(),
            x.shape[0],
            self.out_features,
            self.in_features,
        )
        if status != 0:
            raise MemoryError(f"native linear: no scratch memory for {x.shape[0]} rows of {self.in_features}")
        return out
