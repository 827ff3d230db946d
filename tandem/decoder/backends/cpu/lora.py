"""One projection's LoRA slots bound to `tandem_lora_delta` (csrc/lora.c): a row's delta in a fixed order.

Why a kernel of its own: the reference (models/lora.py) gathers a copy of each row's slot and sums
the products with torch's reductions, one op per part and a dozen per projection; the kernel reads
the slots in place, once per call, and its order per row is fixed (csrc/lora.c's NOTE), so a row's
bits never depend on how many rows share the step or which adapters they use.

Bound once per projection (the table's tensors never move: slots are written in place), so a call
checks only its per-step tensors. The function is read from the build's library by its path: the
one `kernels.py` loaded (a second dlopen of a loaded library returns the same handle).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from tandem.decoder.backends.cpu.kernels import DTYPE_CODES, Kernels, is_plain
from tandem.decoder.models.lora import PARTS, LoraTable, ProjectionLora

_ERRORS = {
    -1: "sizes the kernel cannot take",
    -2: "a slot outside the table (slots must be -1 or a loaded slot)",
    -3: "no scratch memory",
}


@cache
def _function(path: str) -> Any:
    fn = ctypes.CDLL(path).tandem_lora_delta
    pointers, sizes = [ctypes.c_void_p], [ctypes.c_int64]
    fn.restype = ctypes.c_int
    fn.argtypes = pointers * 8 + sizes * 6 + [ctypes.c_int]
    return fn


class CLora:
    """delta(x [num_tokens, in], y [num_tokens, out], slots int64 [num_tokens], scales) -> y, in place."""

    def __init__(self, kernels: Kernels, projection: ProjectionLora, scales: torch.Tensor) -> None:
        dtype = projection.a.dtype
        if dtype not in DTYPE_CODES:
            raise ValueError(f"LoRA weights must be one of {', '.join(map(str, DTYPE_CODES))}, got {dtype}")
        for name, t in (("a", projection.a), ("bt", projection.bt)):
            if not is_plain(t, dtype):
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
        if not (is_plain(projection.ranks, torch.int64) and is_plain(scales, torch.float32)):
            raise ValueError("ranks and scales must be contiguous int64 and float32 CPU tensors")
        self.projection = projection  # held: the pointers below stay valid while this object lives
        self.scales = scales
        self.dtype = dtype
        self.in_features, self.out_features = projection.in_features, projection.out_features
        self._part_ends = torch.tensor(projection.part_ends, dtype=torch.int64)
        self._fn = _function(str(kernels.path))
        num_slots, rows, _ = projection.a.shape
        self._weights = (projection.a.data_ptr(), projection.bt.data_ptr(), projection.ranks.data_ptr(),
                         scales.data_ptr(), self._part_ends.data_ptr())  # fmt: skip
        self._sizes = (num_slots, len(projection.part_ends), projection.max_rank, DTYPE_CODES[dtype])

    def __call__(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if not (is_plain(x, self.dtype) and x.dim() == 2 and x.shape[1] == self.in_features):
            raise ValueError(f"x must be a contiguous {self.dtype} CPU tensor [*, {self.in_features}], "
                             f"got {x.dtype} {list(x.shape)}")  # fmt: skip
        if not (is_plain(y, self.dtype) and tuple(y.shape) == (m, self.out_features)):
            raise ValueError(f"y must be a contiguous {self.dtype} CPU tensor [{m}, {self.out_features}], "
                             f"got {y.dtype} {list(y.shape)}")  # fmt: skip
        if not (is_plain(slots, torch.int64) and tuple(slots.shape) == (m,)):
            raise ValueError(f"slots must be a contiguous int64 CPU tensor [{m}], got {slots.dtype} "
                             f"{list(slots.shape)}")  # fmt: skip
        a, bt, ranks, scales, part_ends = self._weights
        num_slots, num_parts, max_rank, dtype = self._sizes
        status = self._fn(x.data_ptr(), y.data_ptr(), slots.data_ptr(), a, bt, ranks, scales, part_ends,
                          m, self.out_features, self.in_features, num_slots, num_parts, max_rank,
                          dtype)  # fmt: skip
        if status == -3:
            raise MemoryError(f"LoRA delta: no scratch memory for {m} rows")
        if status != 0:
            raise ValueError(f"LoRA delta refused its input: {_ERRORS.get(status, status)}")
        return y


@dataclass(frozen=True)
class LayerCLora:
    """One layer's projections' slots, each bound to the kernel."""

    qkv_proj: CLora
    o_proj: CLora
    gate_up_proj: CLora
    down_proj: CLora


def bind_table(kernels: Kernels, table: LoraTable) -> list[LayerCLora]:
    """Every layer's slots bound to the kernel, once (the executor's, at bind time)."""
    return [
        LayerCLora(*(CLora(kernels, projections[name], table.scales) for name in PARTS))
        for projections in table.layers
    ]
