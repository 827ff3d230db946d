"""A decoder layer's bf16 weights bound to `tandem_attention_in` and `tandem_mlp_block` (csrc/layer.c).

Two C calls do what the module path does in about twenty-five torch ops around attention (norms,
projections, q/k norm + RoPE + cache write, residual adds, SwiGLU); attention itself stays the
layer's attention call between them, and the model's own loop calls the pair as the layer's fused
kernel (models/kernels.py). Bound once by the executor (`executor.py`), with every weight checked
then; a call checks only the per-step tensors and refuses (ValueError naming the argument) what the
kernels cannot read in place. One rank only: tensor parallelism keeps the module path,
whose collectives sit between the projections.

With LoRA slots bound (`lora`), a step whose rows use adapters passes each row's slot and the halves
add each adapted row's delta after each projection, in C (backends/cpu/lora.py); a row of slot -1
gets the plain halves' bits.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.backends.cpu.kernels import Kernels, KernelWeight, is_plain
from tandem.decoder.backends.cpu.lora import LayerCLora, check_slots, functions
from tandem.decoder.models.attention import AttentionMetadata, PagedAttention


@dataclass(frozen=True)
class LayerWeights:
    """The tensors of one decoder layer, as the model holds them (bf16, contiguous, on the CPU; the
    projections may be quantized)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | QuantizedTensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    o: torch.Tensor | QuantizedTensor  # [hidden, num_heads * head_dim]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | QuantizedTensor  # [2 * intermediate, hidden]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor | QuantizedTensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the weights the linear kernel reads
_LORA_SLOT = "a slot outside the LoRA table (slots must be -1 or a loaded slot)"
Shape = tuple[int, int]  # a weight's [out_features, in_features]


def _is_plain_bf16(t: torch.Tensor | None) -> bool:
    return t is None or is_plain(t, torch.bfloat16)


def _kernel_weight(
    kernels: Kernels,
    weight: torch.Tensor | QuantizedTensor,
    dense_rows: int,
    tile_rows: Mapping[Shape, int],
    int8_activations: bool,
) -> KernelWeight:
    if isinstance(weight, QuantizedTensor):
        tiled = tile_rows.get((weight.n, weight.k), 0) if int8_activations else 0
        return kernels.quantized_weight(weight, dense_rows, int8_activations, tiled)
    return kernels.pack_weight(weight, tile_rows=tile_rows.get((weight.shape[0], weight.shape[1]), 0))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLayer:
    """attention_in: h -> q (k, v) with this step's keys and values in the cache; mlp_block: h updated."""

    def __init__(
        self,
        kernels: Kernels,
        weights: LayerWeights,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
        dense_rows: int = 0,  # quantized projections: Kernels.quantized_weight's
        # by shape: Kernels.pack_weight's (bf16) or quantized_weight's (int8 activations)
        tile_rows: Mapping[Shape, int] | None = None,
        int8_activations: bool = False,  # quantized projections: Kernels.quantized_weight's
        lora: LayerCLora | None = None,  # the layer's LoRA slots (bf16); None: no adapters
    ) -> None:
        hidden = weights.input_norm.shape[0]
        head_dim = weights.o.shape[1] // num_heads
        inter = weights.down.shape[1]
        width = (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {
            "input_norm": (hidden,), "qkv": (width, hidden), "qkv_bias": (width,), "q_norm": (head_dim,),
            "k_norm": (head_dim,), "o": (hidden, num_heads * head_dim), "o_bias": (hidden,),
            "post_norm": (hidden,), "gate_up": (2 * inter, hidden), "gate_up_bias": (2 * inter,),
            "down": (hidden, inter), "down_bias": (hidden,),
        }  # fmt: skip
        for name, shape in shapes.items():
            t = getattr(weights, name)
            if isinstance(t, QuantizedTensor) and name in _PROJECTIONS and t.shape == shape:
                continue
            if not _is_plain_bf16(t) or (t is not None and tuple(t.shape) != shape):
                raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor of shape {list(shape)}")
        self.weights = weights
        # The projections as the kernels read them (packed copies on AVX512-BF16 builds); held: the
        # pointers below stay valid while this object lives.
        self.kernel_weights = {
            name: _kernel_weight(
                kernels, getattr(weights, name), dense_rows, tile_rows or {}, int8_activations
            )
            for name in _PROJECTIONS
        }
        # Every weight's pointer, as tandem_attention_in, tandem_mlp_block and the stack take them.
        self.pointers = {
            f.name: self.kernel_weights[f.name].ptr
            if f.name in _PROJECTIONS
            else _ptr(getattr(weights, f.name))
            for f in dataclasses.fields(weights)
        }
        self.hidden, self.head_dim, self.inter = hidden, head_dim, inter
        self.num_heads, self.num_kv_heads, self.eps = num_heads, num_kv_heads, eps
        p = self.pointers
        self._attention_in = kernels.attention_in
        self._mlp_block = kernels.mlp_block
        self._in_ptrs = (p["input_norm"], ctypes.c_float(eps), p["qkv"], p["qkv_bias"],
                         p["q_norm"], p["k_norm"], ctypes.c_float(eps))  # fmt: skip
        self._mlp_ptrs = (p["o"], p["o_bias"], p["post_norm"], ctypes.c_float(eps), p["gate_up"],
                          p["gate_up_bias"], p["down"], p["down_bias"])  # fmt: skip
        self.lora = lora
        self._attention_in_lora: Any = None  # the *_lora entry points, when LoRA slots are bound
        self._mlp_block_lora: Any = None
        if lora is not None:
            sizes = {"qkv_proj": (hidden, width), "o_proj": (num_heads * head_dim, hidden),
                     "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}  # fmt: skip
            for name, (k, n) in sizes.items():
                c = getattr(lora, name)
                if c.dtype != torch.bfloat16 or (c.in_features, c.out_features) != (k, n):
                    raise ValueError(f"LoRA slots of {name} must be bfloat16 [{k} -> {n}], got {c.dtype} "
                                     f"[{c.in_features} -> {c.out_features}]")  # fmt: skip
            lora_fns = functions(kernels)
            self._attention_in_lora, self._mlp_block_lora = lora_fns.attention_in, lora_fns.mlp_block
            self._lora_ptrs = (ctypes.c_void_p * 4)(*lora.pointers)

    def __call__(
        self,
        h: torch.Tensor,  # [num_tokens, hidden], the layer's input, updated in place and returned
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attention: PagedAttention,  # the layer's own, called between the halves
        scale: float,
        lora_slots: torch.Tensor | None = None,  # int64 [num_tokens], each row's LoRA slot; None: none
    ) -> torch.Tensor:
        """The whole layer (models/kernels.py's FusedLayerKernel): both halves around `attention`."""
        want_kv = not attn.is_decode_only  # a prefill attends to this step's keys and values too
        q, k, v = self.attention_in(h, cos, sin, attn.slot_mapping, kv_cache, want_kv, lora_slots)
        return self.mlp_block(h, attention(q, k, v, kv_cache, attn, scale), lora_slots)

    def _accepts(self, h: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (
            is_plain(h, torch.bfloat16)
            and h.dim() == 2
            and h.shape[1] == self.hidden
            and is_plain(kv_cache, torch.bfloat16)
            and kv_cache.dim() == 5
            and kv_cache.shape[0] == 2
            and tuple(kv_cache.shape[3:]) == (self.num_kv_heads, self.head_dim)
        )

    def attention_in(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        want_kv: bool,  # also return this step's keys and values (prefill attends to them)
        lora_slots: torch.Tensor | None = None,  # int64 [num_tokens], each row's LoRA slot; None: none
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [num_tokens, num_heads, head_dim], and k, v [num_tokens, num_kv_heads, head_dim] or None."""
        m = h.shape[0]
        if not self._accepts(h, kv_cache):
            raise ValueError(f"h must be contiguous bfloat16 [*, {self.hidden}] and kv_cache bfloat16 "
                             f"[2, *, *, {self.num_kv_heads}, {self.head_dim}], got {list(h.shape)}, "
                             f"{list(kv_cache.shape)}")  # fmt: skip
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.bfloat16 or t.numel() != m * self.head_dim or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous bfloat16 [{m}, 1, {self.head_dim}]")
        if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (m,):
            raise ValueError(
                f"slot_mapping must be int64 [{m}], got {slot_mapping.dtype} {list(slot_mapping.shape)}"
            )
        slots = slot_mapping.contiguous()
        q = h.new_empty(m, self.num_heads, self.head_dim)
        k = h.new_empty(m, self.num_kv_heads, self.head_dim) if want_kv else None
        v = h.new_empty(m, self.num_kv_heads, self.head_dim) if want_kv else None
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        args = (h.data_ptr(), *self._in_ptrs, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                kv_cache.data_ptr(), num_slots, q.data_ptr(), _ptr(k), _ptr(v), m, self.hidden,
                self.num_heads, self.num_kv_heads, self.head_dim)  # fmt: skip
        if self._call(self._attention_in, self._attention_in_lora, args, lora_slots, m) != 0:
            raise ValueError("fused layer refused its input: slot_mapping: a KV slot is outside kv_cache")
        return q, k, v

    def _call(
        self, plain: Any, with_lora: Any, args: tuple[Any, ...], lora_slots: torch.Tensor | None, m: int
    ) -> int:
        """A half's status: its plain entry point, or (lora_slots given) its *_lora twin with the
        layer's slots and each of the m rows'; a LoRA slot it refused raises."""
        if lora_slots is None:
            return plain(*args)
        if self.lora is None:
            raise ValueError("lora_slots given to a fused layer bound without LoRA slots")
        check_slots(lora_slots, m)
        status = with_lora(*args, self._lora_ptrs, lora_slots.data_ptr())
        if status == -2:
            raise ValueError(f"fused layer refused its input: lora_slots: {_LORA_SLOT}")
        return status

    def mlp_block(
        self,
        h: torch.Tensor,  # [num_tokens, hidden], updated in place and returned
        attn: torch.Tensor,  # [num_tokens, num_heads * head_dim], attention's output
        lora_slots: torch.Tensor | None = None,  # int64 [num_tokens], each row's LoRA slot; None: none
    ) -> torch.Tensor:
        m = h.shape[0]
        width = self.num_heads * self.head_dim
        if attn.dtype != torch.bfloat16 or tuple(attn.shape) != (m, width) or not attn.is_contiguous():
            raise ValueError(
                f"attn must be contiguous bfloat16 [{m}, {width}], got {attn.dtype} {list(attn.shape)}"
            )
        args = (h.data_ptr(), attn.data_ptr(), *self._mlp_ptrs, m, self.hidden, width, self.inter)
        if self._call(self._mlp_block, self._mlp_block_lora, args, lora_slots, m) != 0:
            raise MemoryError(f"fused layer: no scratch memory for {m} tokens")
        return h
