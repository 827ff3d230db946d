"""A linear layer's weight bound once to its kernel: the C kernel, oneDNN's packed bf16, or torch.

- `CLinear`: bf16 through `tandem_linear_bf16` (csrc/linear.c; on AVX512-BF16 builds over a packed
  copy of the weight, csrc/linear_packed.c, or AMX tiles over that copy, csrc/linear_tiles.c).
  Chosen for bf16 wherever a build is loaded except a CPU with oneDNN bf16 and no AVX512-BF16
  build: its sums keep one order whatever the row count. float32 through `tandem_linear_f32`
  (csrc/linear_f32.c), wherever a build is loaded, for the same reason: MKL's float32 GEMM gives a
  row other bits among 2, 3 or 5 rows than alone.
- `PackedLinear`: bf16 through oneDNN with the weight reordered into its blocked layout once, at
  bind time (F.linear would reorder it on every call); bit-identical to F.linear.
- `TorchLinear`: F.linear, for everything else (no build loaded: kernels off).
- `QuantLinear`: a quantized weight (4- or 8-bit codes with fp16 scales per 32 inputs, csrc/
  linear_quant.c) against bf16 or float32 inputs, through `tandem_linear`.

All four are called as `linear(x, with_bias=True)` and carry `.bias`, as the model's row-parallel
helper expects. The weight (and bias) are checked once, when bound: a decode step calls 120 linears
on a 30-layer model, so a call checks only its input, in a handful of attribute reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.decoder.backends.cpu.kernels import (
    DTYPE_CODES,
    WEIGHT_Q4,
    WEIGHT_Q8,
    Kernels,
    KernelWeight,
    is_plain,
)

C_DTYPES = (torch.bfloat16, torch.float32)  # the dense weights CLinear takes


def can_bind(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the C kernel takes this weight and bias: bf16 or float32 (the bias too), contiguous, on
    the CPU, at least one column."""
    return (
        weight.dtype in C_DTYPES
        and is_plain(weight, weight.dtype)
        and weight.dim() == 2
        and weight.shape[1] >= 1
        and (bias is None or is_plain(bias, weight.dtype))
    )


def has_onednn_bf16() -> bool:
    """Whether oneDNN has a bf16 path on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT; AMX included)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_prepack(weight: torch.Tensor) -> bool:
    """bf16 on a CPU whose oneDNN has a bf16 path (elsewhere the reorder raises)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and has_onednn_bf16()


class TorchLinear:
    """F.linear over the model's own weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()  # [out_features, in_features]
        self.bias = None if bias is None else bias.detach()  # [out_features]

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if with_bias else None)


class PackedLinear(TorchLinear):
    """oneDNN's bf16 linear over the weight packed once (can_prepack must hold)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)  # opaque blocked layout

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class CLinear:
    """x [num_tokens, in_features] -> x @ weight.T (+ bias) [num_tokens, out_features], in the weight's
    dtype (bf16 or float32).

    fp32 accumulation and, for bf16, one rounding, like torch's linear; the sums run in another order,
    so a result may differ from torch's in its last bit.
    """

    def __init__(
        self,
        kernels: Kernels,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tile_rows: int = 0,  # bf16: calls of this many rows on run on AMX tiles (pack_weight); 0: never
    ) -> None:
        if not can_bind(weight, None):
            raise ValueError(
                "weight must be a contiguous 2-D bfloat16 or float32 CPU tensor with at least one column, "
                f"got {weight.dtype} {list(weight.shape)} on {weight.device}"
            )
        out_features, in_features = weight.shape
        dtype = weight.dtype
        if bias is not None and not (is_plain(bias, dtype) and tuple(bias.shape) == (out_features,)):
            raise ValueError(
                f"bias must be a contiguous {str(dtype).removeprefix('torch.')} CPU tensor of shape "
                f"[{out_features}] to match weight, got {bias.dtype} {list(bias.shape)} on {bias.device}"
            )
        if dtype == torch.float32 and tile_rows:
            raise ValueError("tile_rows needs a bf16 weight (the tiles multiply bf16)")
        # Held so the pointers below stay valid for as long as this object lives.
        self.weight = weight.detach()  # [out_features, in_features]
        self.bias = None if bias is None else bias.detach()  # [out_features]
        self.kernel_weight = (  # as the kernel reads it
            kernels.float_weight(self.weight)
            if dtype == torch.float32
            else kernels.pack_weight(self.weight, tile_rows=tile_rows)
        )
        self._call = _KernelCall(kernels, self.kernel_weight, self.bias, dtype)

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return self._call(x, with_bias)


class QuantLinear:
    """x [num_tokens, in_features] (bf16 or float32) -> x @ weight.T (+ bias), weight quantized.

    Each output is sum over blocks of d (x . q) + m (sum of x), in fp32, rounded once to x's dtype.
    """

    def __init__(
        self, kernels: Kernels, weight: KernelWeight, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        if weight.format not in (WEIGHT_Q4, WEIGHT_Q8) or dtype not in DTYPE_CODES:
            raise ValueError(f"QuantLinear takes a quantized weight and bf16 or float32 inputs, got {dtype}")
        if bias is not None and not (is_plain(bias, dtype) and tuple(bias.shape) == (weight.n,)):
            raise ValueError(
                f"bias must be a contiguous {dtype} CPU tensor of shape [{weight.n}] to match weight, "
                f"got {bias.dtype} {list(bias.shape)} on {bias.device}"
            )
        self.kernel_weight = weight
        self.bias = None if bias is None else bias.detach()  # [out_features]
        self._call = _KernelCall(kernels, weight, self.bias, dtype)

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return self._call(x, with_bias)


class KernelLinear:
    """A weight already bound for the kernels (a fused layer's) called as a linear, no second copy:
    a step's part that runs op by op (prefill_split.py) reads the fused layers' own packed weights."""

    def __init__(self, kernels: Kernels, weight: KernelWeight, bias: torch.Tensor | None) -> None:
        self.kernel_weight = weight
        self.bias = None if bias is None else bias.detach()  # [out_features]
        self._call = _KernelCall(kernels, weight, self.bias, torch.bfloat16)

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return self._call(x, with_bias)


class _KernelCall:
    """One bound call of tandem_linear: the input checked, the output allocated, the status read."""

    def __init__(
        self, kernels: Kernels, weight: KernelWeight, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        self._fn = kernels.linear
        self.out_features, self.in_features, self.dtype = weight.n, weight.k, dtype
        self._weight_ptr = weight.ptr
        self._bias_ptr = None if bias is None else bias.data_ptr()
        self._dtype_code = DTYPE_CODES[dtype]

    def __call__(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        if not (is_plain(x, self.dtype) and x.dim() == 2 and x.shape[1] == self.in_features):
            raise ValueError(
                f"x must be a contiguous {str(self.dtype).removeprefix('torch.')} CPU tensor of shape "
                f"[*, {self.in_features}] to match "
                f"weight, got {x.dtype} {list(x.shape)} on {x.device}"
            )
        out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        status = self._fn(
            x.data_ptr(),
            self._weight_ptr,
            self._bias_ptr if with_bias else None,
            out.data_ptr(),
            x.shape[0],
            self.out_features,
            self.in_features,
            self._dtype_code,
        )
        if status != 0:
            raise MemoryError(f"C linear: no scratch memory for {x.shape[0]} rows of {self.in_features}")
        return out
