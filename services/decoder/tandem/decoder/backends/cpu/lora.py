"""LoRA slots bound to the C kernels: `tandem_lora_delta` (csrc/lora.c) and the fused layers' and the
decode stack's `*_lora` entry points (csrc/layer.c), each row's delta in a fixed order.

Why kernels of their own: the reference (models/lora.py) gathers a copy of each row's slot and sums
the products with torch's reductions, one op per part and a dozen per projection; the kernel reads
the slots in place, groups the rows by slot so that each adapter's A and B are read once a call
(Punica's SGMV), and its order per row is fixed (csrc/lora.c's NOTEs), so a row's bits never depend
on how many rows share the step or which adapters they use. Inside the fused layers the deltas cost
no call of their own: a step with adapters keeps the fused path and, decoding, the one-call stack.

Each projection's slots are described once (lora.h's TandemLoraWeight: the table's tensors never
move, a slot is rewritten in place), so a call checks only its per-step tensors; the C side checks
every slot against the table before it writes anything. The functions are read from the build's
library by its path: the one `kernels.py` loaded (a second dlopen of a loaded library returns the
same handle), with the argument types kernels.py gave the plain entry points, plus two pointers.
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


class TandemLoraWeight(ctypes.Structure):
    """lora.h's descriptor of one projection's slots."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("bt", ctypes.c_void_p),
        ("ranks", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("part_ends", ctypes.c_void_p),
        ("num_slots", ctypes.c_int64),
        ("num_parts", ctypes.c_int64),
        ("max_rank", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("dtype", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class LoraFunctions:
    """A build's LoRA entry points (see the module's docstring)."""

    delta: Any  # tandem_lora_delta(weight, x, y, slots, m)
    attention_in: Any  # tandem_attention_in's arguments, then the layer's slots and each row's slot
    mlp_block: Any  # tandem_mlp_block's, then the same two
    decode_layers: Any  # tandem_decode_layers', then every layer's slots and each row's slot


@cache
def _functions(path: str, attention_in: tuple[Any, ...], mlp_block: tuple[Any, ...],
               decode_layers: tuple[Any, ...]) -> LoraFunctions:  # fmt: skip
    library = ctypes.CDLL(path)
    pointers = [ctypes.c_void_p] * 2

    def bind(name: str, argtypes: list[Any]) -> Any:
        fn = getattr(library, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        return fn

    return LoraFunctions(
        delta=bind("tandem_lora_delta", [ctypes.c_void_p] * 4 + [ctypes.c_int64]),
        attention_in=bind("tandem_attention_in_lora", [*attention_in, *pointers]),
        mlp_block=bind("tandem_mlp_block_lora", [*mlp_block, *pointers]),
        decode_layers=bind("tandem_decode_layers_lora", [*decode_layers, *pointers]),
    )


def functions(kernels: Kernels) -> LoraFunctions:
    """The LoRA entry points of the build `kernels` loaded."""
    argtypes = (kernels.attention_in.argtypes, kernels.mlp_block.argtypes, kernels.decode_layers.argtypes)
    return _functions(str(kernels.path), *(tuple(a) for a in argtypes))


def check_slots(slots: torch.Tensor, m: int) -> None:
    """A step's per-row slots as the kernels read them: contiguous int64 [m] (their values: the C side)."""
    if not (is_plain(slots, torch.int64) and tuple(slots.shape) == (m,)):
        raise ValueError(
            f"slots must be a contiguous int64 CPU tensor [{m}], got {slots.dtype} {list(slots.shape)}"
        )


class CLora:
    """delta(x [num_tokens, in], y [num_tokens, out], slots int64 [num_tokens]) -> y, in place."""

    def __init__(self, kernels: Kernels, projection: ProjectionLora, scales: torch.Tensor) -> None:
        dtype = projection.a.dtype
        if dtype not in DTYPE_CODES:
            raise ValueError(f"LoRA weights must be one of {', '.join(map(str, DTYPE_CODES))}, got {dtype}")
        for name, t in (("a", projection.a), ("bt", projection.bt)):
            if not is_plain(t, dtype):
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
        if not (is_plain(projection.ranks, torch.int64) and is_plain(scales, torch.float32)):
            raise ValueError("ranks and scales must be contiguous int64 and float32 CPU tensors")
        self.projection = projection  # held: the descriptor's pointers stay valid while this object lives
        self.scales = scales
        self.dtype = dtype
        self.in_features, self.out_features = projection.in_features, projection.out_features
        self._part_ends = torch.tensor(projection.part_ends, dtype=torch.int64)
        self.weight = TandemLoraWeight(
            projection.a.data_ptr(), projection.bt.data_ptr(), projection.ranks.data_ptr(), scales.data_ptr(),
            self._part_ends.data_ptr(), projection.a.shape[0], len(projection.part_ends), projection.max_rank,
            self.out_features, self.in_features, DTYPE_CODES[dtype],
        )  # fmt: skip
        self.ptr = ctypes.addressof(self.weight)
        self._fn = functions(kernels).delta

    def __call__(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if not (is_plain(x, self.dtype) and x.dim() == 2 and x.shape[1] == self.in_features):
            raise ValueError(f"x must be a contiguous {self.dtype} CPU tensor [*, {self.in_features}], "
                             f"got {x.dtype} {list(x.shape)}")  # fmt: skip
        if not (is_plain(y, self.dtype) and tuple(y.shape) == (m, self.out_features)):
            raise ValueError(f"y must be a contiguous {self.dtype} CPU tensor [{m}, {self.out_features}], "
                             f"got {y.dtype} {list(y.shape)}")  # fmt: skip
        check_slots(slots, m)
        status = self._fn(self.ptr, x.data_ptr(), y.data_ptr(), slots.data_ptr(), m)
        if status == -3:
            raise MemoryError(f"LoRA delta: no scratch memory for {m} rows")
        if status != 0:
            raise ValueError(f"LoRA delta refused its input: {_ERRORS.get(status, status)}")
        return y


@dataclass(frozen=True)
class LayerCLora:
    """One layer's projections' slots, each bound to the kernel (fields in PARTS' order, lora.h's)."""

    qkv_proj: CLora
    o_proj: CLora
    gate_up_proj: CLora
    down_proj: CLora

    @property
    def pointers(self) -> list[int]:
        """The four descriptors' addresses, as the fused entry points take them."""
        return [getattr(self, name).ptr for name in PARTS]


def pointer_array(layers: list[LayerCLora]) -> ctypes.Array[ctypes.c_void_p]:
    """Every layer's descriptors back to back: [len(layers)][4] pointers (the callers hold `layers`)."""
    pointers = [p for layer in layers for p in layer.pointers]
    return (ctypes.c_void_p * len(pointers))(*pointers)


def bind_table(kernels: Kernels, table: LoraTable) -> list[LayerCLora]:
    """Every layer's slots bound to the kernel, once (the executor's, at bind time)."""
    return [
        LayerCLora(*(CLora(kernels, projections[name], table.scales) for name in PARTS))
        for projections in table.layers
    ]
