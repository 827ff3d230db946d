"""One decoder layer's per-op kernels on the CPU: what the model's modules run when its layers do not fuse.

The executor (executor.py) binds, per layer, the projections it chose (linear.py: the C kernel,
oneDNN's packed bf16 or F.linear), and, when a build is loaded and the sizes fit, the two norms and
the q/k norm + RoPE + KV write as the C custom ops (ops.py). The model's own modules call them in
their own order (models/kernels.py's NOTE); what is not bound here runs the module's torch code.
LoRA slots bound to the C kernel give the layer's deltas on it (lora.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from tandem.decoder.backends.cpu.lora import LayerCLora
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.kernels import LayerKernels
from tandem.decoder.models.layers import RMSNorm
from tandem.decoder.models.linear import Projection
from tandem.decoder.models.lora import LayerLora
from tandem.decoder.models.transformer import Attention, DecoderLayer


class CNorm:
    """RMSNorm through the C op, its weight and epsilon bound: x [num_tokens, size] -> [num_tokens, size]."""

    def __init__(self, ops: Any, norm: RMSNorm) -> None:
        self._op = ops.rms_norm
        self.weight = norm.weight  # [size]
        self.eps = norm.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.weight, self.eps)


class CRopeCache:
    """Attention.rope_and_cache through the C op: q/k norm (Qwen3), RoPE and the KV write in one call."""

    def __init__(self, ops: Any, attention: Attention) -> None:
        a = attention
        self._op = ops.qkv_rope_cache
        # Qwen3's per-head norms (Llama: None, None; its epsilon then goes unread).
        self.q_norm = None if a.q_norm is None else a.q_norm.weight  # [head_dim]
        self.k_norm = None if a.k_norm is None else a.k_norm.weight  # [head_dim]
        self.eps = a.q_norm.eps if a.q_norm is not None else 0.0
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.v_start = a.q_size + a.kv_size  # the values' first column in qkv

    def __call__(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = self._op(
            qkv, cos, sin, self.q_norm, self.k_norm, self.eps, kv_cache, attn.slot_mapping,
            self.num_heads, not attn.is_decode_only,
        )  # fmt: skip
        v = qkv[:, self.v_start :].view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v


def c_deltas(lora: LayerCLora, slots: torch.Tensor) -> LayerLora:
    """A layer's LoRA deltas on the C kernel for a step's rows' slots (int64 [num_tokens])."""
    return LayerLora(
        partial(lora.qkv_proj, slots=slots),
        partial(lora.o_proj, slots=slots),
        partial(lora.gate_up_proj, slots=slots),
        partial(lora.down_proj, slots=slots),
        slots,
    )


def per_op(
    layer: DecoderLayer,
    ops: Any | None,  # torch.ops.tandem_<level>; None: torch norms and RoPE
    linears: Mapping[str, Projection],  # "qkv", "o", "gate_up", "down": each projection's bound kernel
    lora: LayerCLora | None = None,  # the layer's LoRA slots on the C kernel; None: none or torch's
) -> LayerKernels:
    """The layer op by op: its projections as bound, its norms and RoPE + KV write in C where `ops`."""
    return LayerKernels(
        input_norm=None if ops is None else CNorm(ops, layer.input_layernorm),
        qkv=linears["qkv"],
        rope_cache=None if ops is None else CRopeCache(ops, layer.self_attn),
        o=linears["o"],
        post_norm=None if ops is None else CNorm(ops, layer.post_attention_layernorm),
        gate_up=linears["gate_up"],
        down=linears["down"],
        lora=None if lora is None else partial(c_deltas, lora),
    )
