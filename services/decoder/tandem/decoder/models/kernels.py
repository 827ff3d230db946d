"""What a backend binds into the model's forward: kernels that run a module's work in place of its torch ops.

NOTE: the rule. `DecoderModel.hidden_states` is the only walk over the layers, whoever runs the step.
A backend that has faster kernels (the CPU executor, backends/cpu/executor.py) binds them once, at
load, into a `ModelKernels` and passes it to every call; each module asks its own entry for its
kernel and runs its torch code where that entry is None. So the plain model (no kernels) is the
reference, and a bound model differs from it only inside the modules, never in the order of the
walk, the residual adds, the collectives or which rows reach the head.

A bound kernel computes what its module computes, for each row alone: a row's bits never depend on
how many rows share the call (the backends' kernels keep one order of sums per row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.decoder.models.attention import AttentionMetadata, PagedAttention
from tandem.decoder.models.linear import Projection
from tandem.decoder.models.lora import LayerLora, LoraStep

# RMSNorm with its weight and epsilon bound: x [num_tokens, size] -> [num_tokens, size].
NormKernel = Callable[[torch.Tensor], torch.Tensor]


# Attention.rope_and_cache: (qkv [num_tokens, q_size + 2 * kv_size], cos and sin [num_tokens, 1,
# head_dim], attn, kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]) -> q, k, v [num_tokens,
# heads, head_dim], the heads normed (Qwen3) and rotated, this step's keys and values written to the
# cache. k may come back with no rows on a decode-only step (nothing reads it).
RopeCacheKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]

# A whole decoder layer but its attention call, which it makes through the layer's own `attention`:
# (h [num_tokens, hidden_size] the layer's input, which it may update in place; cos, sin; attn;
# kv_cache; attention; scale; lora_slots int64 [num_tokens] or None: no row adapted) -> the layer's
# output [num_tokens, hidden_size].
FusedLayerKernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        torch.Tensor,
        PagedAttention,
        float,
        torch.Tensor | None,
    ],
    torch.Tensor,
]

# A layer's LoRA deltas on a backend's kernel, for a step's rows' slots (int64 [num_tokens]).
LoraKernel = Callable[[torch.Tensor], LayerLora]


@dataclass(frozen=True)
class LayerKernels:
    """One decoder layer's bound kernels; a field left None runs its module's torch code."""

    input_norm: NormKernel | None = None  # input_layernorm
    qkv: Projection | None = None  # self_attn.qkv_proj
    rope_cache: RopeCacheKernel | None = None  # self_attn.rope_and_cache
    o: Projection | None = None  # self_attn.o_proj
    post_norm: NormKernel | None = None  # post_attention_layernorm
    gate_up: Projection | None = None  # mlp.gate_up_proj
    down: Projection | None = None  # mlp.down_proj
    lora: LoraKernel | None = None  # the step's deltas for this layer; None: LoraStep.layer's (torch)
    fused: FusedLayerKernel | None = None  # the whole layer in place of every field above but `lora`


PLAIN = LayerKernels()  # nothing bound: every module on its torch code


# The model's own loop over its layers, as a walk kernel calls it:
# (h, cos, sin, attn, kv_caches, lora, layers) -> the last layer's output [num_tokens, hidden_size].
LayerLoop = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        list[torch.Tensor],
        LoraStep | None,
        tuple[LayerKernels, ...],
    ],
    torch.Tensor,
]


# Every layer of a one-rank step: (loop, h, cos, sin, attn, kv_caches, lora, layers) -> the last
# layer's output [num_tokens, hidden_size]. It calls the model's loop, once or per part of the step,
# with the layers' kernels it chooses (`layers` is ModelKernels.layers), or runs every layer itself (a
# one-call decode stack).
WalkKernel = Callable[
    [
        LayerLoop,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        list[torch.Tensor],
        LoraStep | None,
        tuple[LayerKernels, ...],
    ],
    torch.Tensor,
]


@dataclass(frozen=True)
class ModelKernels:
    """Everything a backend bound for one model, chosen once and passed to each step."""

    layers: tuple[LayerKernels, ...]  # one per decoder layer, in order
    head: Projection | None = None  # the LM head (lm_head or the tied table); None: F.linear
    walk: WalkKernel | None = None  # a one-rank step's layers; None: the model's loop
