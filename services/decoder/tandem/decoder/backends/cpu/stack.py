"""Every layer of a decode-only step in one C call (`tandem_decode_layers`, csrc/layer.c).

Per layer, the fused path is three C calls (attention_in, decode attention, mlp_block), each behind
a Python wrapper that checks its tensors: for a small model, most of a decode step's host work at
batch 1. Here the step's tensors are checked once and the layers run back to back in C, the same
kernels in the same order as the per-layer calls, so the results are the same bits. Steps with any
prefill keep the per-layer path.

Bound by the executor (`executor.py`) when every layer is fused (FusedLayer) and the attention is the
C decode kernel. With LoRA slots (the fused layers' own), a step whose rows use adapters runs the
same call with each row's slot, every layer adding the deltas as its fused halves do.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from tandem.decoder.backends.cpu.kernels import Kernels, is_plain
from tandem.decoder.backends.cpu.layer import FusedLayer
from tandem.decoder.backends.cpu.limits import fits
from tandem.decoder.backends.cpu.lora import check_slots, functions, pointer_array
from tandem.decoder.models.attention import AttentionMetadata

# The order of each layer's pointers in the weights array: layer_kernels.c's W_* enum.
_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up",
            "gate_up_bias", "down", "down_bias")  # fmt: skip
_ERRORS = {
    1: "slot_mapping: a KV slot is outside kv_cache",
    2: "a sequence length (seq_lens) or block id (block_tables) is outside kv_cache",
    4: "lora_slots: a slot outside the LoRA table (slots must be -1 or a loaded slot)",
}


class DecodeStack:
    """run: h [m, hidden] through every layer of a decode-only step, in place."""

    def __init__(self, kernels: Kernels, layers: list[FusedLayer], scale: float) -> None:
        first = layers[0]
        if len({(n.hidden, n.head_dim, n.inter, n.num_heads, n.num_kv_heads, n.eps) for n in layers}) != 1:
            raise ValueError("every layer must have the same sizes and norm epsilon to run as one stack")
        heads = fits(kernels.limits, head_dim=first.head_dim, num_heads=first.num_heads,
                     num_kv_heads=first.num_kv_heads)  # fmt: skip
        if not heads:
            raise ValueError(f"the layers' heads must fit the C decode attention: {heads.reason}")
        self.limits = kernels.limits
        self.layers = layers  # held: the weight pointers below stay valid while this object lives
        self.scale = scale
        self.hidden, self.head_dim, self.inter = first.hidden, first.head_dim, first.inter
        self.num_heads, self.num_kv_heads, self.eps = first.num_heads, first.num_kv_heads, first.eps
        pointers = [layer.pointers[name] for layer in layers for name in _WEIGHTS]
        self._weights = (ctypes.c_void_p * len(pointers))(*pointers)  # [num_layers][len(_WEIGHTS)]
        self._kv_type = ctypes.c_void_p * len(layers)
        self._run = kernels.decode_layers
        # Every layer's LoRA slots, when the layers have them (all or none: the executor binds them so).
        loras = [layer.lora for layer in layers if layer.lora is not None]
        self._lora = pointer_array(loras) if len(loras) == len(layers) else None
        self._run_lora = functions(kernels).decode_layers if self._lora is not None else None
        # The caches last checked (weakly: the runner owns them) and their pointers. The runner passes
        # the same caches every step: checking them all again would be per-step host work for nothing.
        self._caches: list[weakref.ref[torch.Tensor]] = []
        self._cache_pointers: ctypes.Array[ctypes.c_void_p] | None = None
        self._cache_shape: torch.Size | None = None  # theirs, as checked

    def run(
        self,
        h: torch.Tensor,  # [num_tokens, hidden], updated in place and returned
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,  # decode-only: one query per sequence
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        lora_slots: torch.Tensor | None = None,  # int64 [num_tokens], each row's LoRA slot; None: none
    ) -> torch.Tensor:
        m = h.shape[0]
        if not attn.is_decode_only or len(attn.query_lens) != m:
            raise ValueError(f"a stack step is decode-only with one row per sequence: {m} rows, "
                             f"query_lens {attn.query_lens}")  # fmt: skip
        self._check(h, cos, sin, attn)
        caches, (_, num_blocks, block_size, _, _) = self._checked_caches(kv_caches)
        width = self.num_heads * self.head_dim
        q = h.new_empty(m, width)
        out = h.new_empty(m, width)
        tables = attn.block_tables
        args = (h.data_ptr(), self._weights, caches, len(self.layers), self.eps, cos.data_ptr(),
                sin.data_ptr(), attn.slot_mapping.data_ptr(), tables.data_ptr(), attn.seq_lens_t.data_ptr(),
                tables.shape[1], num_blocks, block_size, self.scale, q.data_ptr(), out.data_ptr(), m,
                self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.inter)  # fmt: skip
        if lora_slots is None:
            status = self._run(*args)
        elif self._run_lora is None:
            raise ValueError("lora_slots given to a decode stack bound without LoRA slots")
        else:
            check_slots(lora_slots, m)
            status = self._run_lora(*args, self._lora, lora_slots.data_ptr())
        if status == 3:
            raise MemoryError(f"decode stack: no scratch memory for {m} tokens")
        if status != 0:
            raise ValueError(f"decode stack refused their input: {_ERRORS.get(status, status)}")
        return h

    def _check(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata) -> None:
        """The C side checks slots, lengths and block ids; everything it reads by size is checked here."""
        m, d = h.shape[0], self.head_dim
        if not is_plain(h, torch.bfloat16) or h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(
                f"h must be contiguous bfloat16 [*, {self.hidden}], got {h.dtype} {list(h.shape)}"
            )
        for name, t in (("cos", cos), ("sin", sin)):
            if not is_plain(t, torch.bfloat16) or t.numel() != m * d:
                raise ValueError(f"{name} must be contiguous bfloat16 [{m}, 1, {d}]")
        for name, t, dtype, want in (
            ("slot_mapping", attn.slot_mapping, torch.int64, (m,)),
            ("seq_lens", attn.seq_lens_t, torch.int32, (m,)),
            ("block_tables", attn.block_tables, torch.int32, (m, attn.block_tables.shape[-1])),
        ):
            if not is_plain(t, dtype) or tuple(t.shape) != want:
                got = f"{t.dtype} {list(t.shape)}"
                raise ValueError(f"{name} must be contiguous {dtype} {list(want)} on the CPU, got {got}")

    def _checked_caches(
        self, kv_caches: list[torch.Tensor]
    ) -> tuple[ctypes.Array[ctypes.c_void_p], torch.Size]:
        """The caches' pointers and shape; checked in full unless they are the last caches checked, at
        the same addresses (a cache whose storage was swapped is checked again)."""
        pointers, checked_shape = self._cache_pointers, self._cache_shape
        if (
            pointers is not None
            and checked_shape is not None
            and len(kv_caches) == len(self._caches)
            and all(
                ref() is c and c.data_ptr() == p
                for ref, c, p in zip(self._caches, kv_caches, pointers, strict=True)
            )
        ):
            return pointers, checked_shape
        if len(kv_caches) != len(self.layers) or not kv_caches:
            raise ValueError(
                f"kv_caches must be {len(self.layers)} tensors, one per layer, got {len(kv_caches)}"
            )
        shape = kv_caches[0].shape
        if len(shape) != 5 or shape[0] != 2 or tuple(shape[3:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"kv_cache must be bfloat16 [2, *, *, {self.num_kv_heads}, {self.head_dim}], "
                             f"got {list(shape)}")  # fmt: skip
        if not (fit := fits(self.limits, block_size=shape[2])):
            raise ValueError(f"kv_cache must fit the C decode attention: {fit.reason}")
        if not all(c.shape == shape and is_plain(c, torch.bfloat16) for c in kv_caches):
            raise ValueError(f"kv_caches must be {len(self.layers)} contiguous bfloat16 tensors of one shape")
        self._caches = [weakref.ref(c) for c in kv_caches]
        self._cache_pointers = self._kv_type(*[c.data_ptr() for c in kv_caches])
        self._cache_shape = shape
        return self._cache_pointers, shape
