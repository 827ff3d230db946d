"""The decoder stack shared by Qwen3 and Llama; each family's file states only what differs.

Parameter names follow the Hugging Face checkpoints (minus the leading "model."), except that
q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj`: one GEMM each instead of three and
two. `checkpoint_parts` tells the loader which checkpoint tensors (and which shard of each) make up
each parameter. With a ParallelGroup the model holds this rank's shard only; where the collectives
go is described in `tensor_parallel.py`. Without one (a single rank) the forward is the plain model.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from services.decoder.models.attention import AttentionMetadata, PagedAttention, write_kv_cache
from services.decoder.models.config import ModelConfig
from services.decoder.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rotary,
    merge_prompt_embeds,
)
from services.decoder.models.linear import Linear, can_prepack, pack_weight
from services.decoder.models.native import NativeKernels
from services.decoder.models.native_layer import LayerWeights, NativeLayer
from services.decoder.models.native_linear import NativeLinear, can_bind
from services.decoder.models.native_stack import NativeStack
from services.decoder.models.tensor_parallel import (
    CheckpointPart,
    ParallelGroup,
    VocabParallelEmbedding,
    checkpoint_parts,
    gather_sequence,
    local_rows,
    row_parallel,
    rows_for_logits,
    vocab_parallel_logits,
    world_size_of,
)
from services.decoder.models.torch_attention import TorchPagedAttention


class Attention(nn.Module):
    """QKV column-parallel (this rank's query and KV heads), o_proj row-parallel."""

    def __init__(self, config: ModelConfig, use_qk_norm: bool, tp: ParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_heads // world_size_of(tp)  # on this rank
        self.num_kv_heads = config.num_kv_heads // world_size_of(tp)  # on this rank
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        # Qwen3 normalises each query and key head before RoPE; Llama does not.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if use_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if use_qk_norm else None
        self.norm_eps = config.rms_norm_eps  # of q_norm and k_norm, for the fused kernel
        self.native: NativeKernels | None = None  # set by DecoderModel.use_native_kernels
        # The backend's implementation (DecoderModel.use_attention); torch ops until one is set.
        self.attention: PagedAttention = TorchPagedAttention()

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size], or this rank's [local_len, hidden_size] under SP
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (this rank's heads)
        sp: bool = False,  # sequence parallel: x is a slice, and so is the output
    ) -> torch.Tensor:
        x = gather_sequence(x, self.tp, sp)  # [num_tokens, hidden_size]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        if self.native is not None and self.native.supports_qkv(qkv, cos, sin, kv_cache):
            # Norms, RoPE and the cache write in one pass; decode steps read keys from the cache only.
            q, k = self.native.qkv_rope_cache(
                qkv,
                cos,
                sin,
                _weight(self.q_norm),
                _weight(self.k_norm),
                self.norm_eps,
                kv_cache,
                attn.slot_mapping,
                self.num_heads,
                want_keys=not attn.is_decode_only,
            )
        else:
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            write_kv_cache(kv_cache, k, v, attn.slot_mapping)
        out = self.attention(q, k, v, kv_cache, attn, self.scale)  # [num_tokens, num_heads * head_dim]
        return row_parallel(self.o_proj, out, self.tp, sp)  # [num_tokens or local_len, hidden_size]


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _bind_layer(
    kernels: NativeKernels | None, layer: DecoderLayer, tp: ParallelGroup | None
) -> NativeLayer | None:
    """Both halves of the layer in C, when its linears went to the C kernel and there is one rank."""
    a, mlp = layer.self_attn, layer.mlp
    linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if kernels is None or tp is not None or any(linear.native is None for linear in linears):
        return None
    weights = LayerWeights(
        input_norm=layer.input_layernorm.weight, qkv=a.qkv_proj.weight, qkv_bias=a.qkv_proj.bias,
        q_norm=_weight(a.q_norm), k_norm=_weight(a.k_norm), o=a.o_proj.weight, o_bias=a.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight, gate_up=mlp.gate_up_proj.weight,
        gate_up_bias=mlp.gate_up_proj.bias, down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
    )  # fmt: skip
    if layer.input_layernorm.eps != a.norm_eps or layer.post_attention_layernorm.eps != a.norm_eps:
        return None  # the kernels take one epsilon for every norm of the layer
    return NativeLayer(kernels, weights, a.num_heads, a.num_kv_heads, a.norm_eps)


def _bind_stack(
    kernels: NativeKernels | None, layers: nn.ModuleList, attention: TorchPagedAttention
) -> NativeStack | None:
    """Decode-only steps' layers in one C call, when every layer is fused and the C decode kernel
    takes the model's attention shapes; else None (the per-layer path)."""
    natives = [layer.native for layer in layers]
    scales = {layer.self_attn.scale for layer in layers}
    if kernels is None or not natives or any(n is None for n in natives) or len(scales) != 1:
        return None
    try:
        return NativeStack(kernels, [n for n in natives if n is not None], attention, scales.pop())
    except ValueError:
        return None  # layers of different sizes, or heads past the C attention's limits


def _bind_linear(
    kernels: NativeKernels | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
) -> NativeLinear | None:
    """The C kernel for a bf16 weight that oneDNN did not pack (it has no bf16 path here), else None."""
    if kernels is None or packed is not None or not can_bind(weight):
        return None
    if bias is not None and bias.dtype != weight.dtype:
        return None
    return NativeLinear(kernels, weight, bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, use_qk_norm: bool, tp: ParallelGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, use_qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)
        self.native: NativeLayer | None = None  # set by DecoderModel.use_native_kernels (one rank, bf16)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden_size], or this rank's [local_len, hidden_size] under SP
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        sp: bool = False,
    ) -> torch.Tensor:
        native, attention = self.native, self.self_attn
        if native is not None and native.accepts(h, kv_cache):
            # Everything but attention in two C calls; h is this layer's own input, updated in place.
            q, k, v = native.attention_in(h, cos, sin, attn.slot_mapping, kv_cache, not attn.is_decode_only)
            out = attention.attention(q, k, v, kv_cache, attn, attention.scale)
            return native.mlp_block(h, out)
        # Norms and residual adds run on whatever rows this rank holds: its slice under SP.
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, kv_cache, sp)
        return h + self.mlp(self.post_attention_layernorm(h), sp)  # same rows as h


class DecoderModel(nn.Module):
    """Token embedding on the device, prompt-embeds merge, decoder layers, LM head at chosen rows."""

    use_qk_norm: ClassVar[bool] = False  # per-head RMSNorm on queries and keys before RoPE

    def __init__(self, config: ModelConfig, tp: ParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp  # None: one rank, the whole model here
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.use_qk_norm, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # Tied checkpoints carry no lm_head.weight; the head then reads embed_tokens.weight.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size // world_size_of(tp), bias=False)
        )
        self.packed_head: torch.Tensor | None = None  # set by prepack(): the head in oneDNN's layout
        self.native_head: NativeLinear | None = None  # set by use_native_kernels: the head's C kernel
        self.native_stack: NativeStack | None = None  # set by use_native_kernels: decode steps' layers in C

    def forward(
        self,
        input_ids: torch.Tensor,  # int32 [num_tokens], 0 at embedding positions
        positions: torch.Tensor,  # int32 or int64 [num_tokens]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size] in the model dtype
        is_token_ids: torch.Tensor | None = None,  # bool [num_tokens], True = token path
    ) -> torch.Tensor:
        """Runs one step and returns float32 logits [num_logits, vocab_size] at attn.logits_indices.

        With several ranks every rank returns the same logits. A step with any prefill runs
        sequence-parallel and needs its token count padded to a multiple of the world size.
        """
        h = self.hidden_states(input_ids, positions, attn, kv_caches, inputs_embeds, is_token_ids)
        return self.compute_logits(h)  # [num_logits, vocab_size]

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # int32 [num_tokens], 0 at embedding positions
        positions: torch.Tensor,  # int32 or int64 [num_tokens]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size] in the model dtype
        is_token_ids: torch.Tensor | None = None,  # bool [num_tokens], True = token path
    ) -> torch.Tensor:
        """`forward` without the LM head: the final hidden rows [num_logits, hidden_size] at
        attn.logits_indices, for a caller that takes the logits of many rows a slice at a time."""
        tp = self.tp
        sp = tp is not None and not attn.is_decode_only
        if sp and input_ids.shape[0] % tp.world_size:
            raise ValueError(
                f"a sequence-parallel step needs num_tokens ({input_ids.shape[0]}) padded to a multiple "
                f"of the world size ({tp.world_size})"
            )
        h = self.embed_tokens(input_ids, sp)  # [num_tokens, hidden_size], or [local_len, ...] under SP
        # Every rank cuts the same window out of the per-position inputs, then merges on its slice.
        h = merge_prompt_embeds(h, local_rows(inputs_embeds, tp, sp), local_rows(is_token_ids, tp, sp))
        cos, sin = self.rotary(positions, h.dtype)  # [num_tokens, 1, head_dim] each, shared by all layers
        stack = self.native_stack
        if stack is not None and attn.is_decode_only and stack.takes([layer.native for layer in self.layers]):
            h = stack.run(h, cos, sin, attn, kv_caches)  # every layer in one C call
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                h = layer(h, cos, sin, attn, kv_cache, sp)
        # The norm is per row, so only the rows whose logits are wanted go through it and the head.
        return self.norm(rows_for_logits(h, attn.logits_indices, tp, sp))  # [num_logits, hidden_size]

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size] of final hidden rows h [num_rows, hidden_size].

        With several ranks a collective: every rank calls it with the same rows.
        """
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(h, head, self.tp, self.packed_head, self.native_head)

    def prepack(self) -> None:
        """Pack every projection and the LM head for oneDNN (bf16 on CPU; a no-op elsewhere).

        Call once the weights are final and on their device: the packed copies are derived.
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_head = pack_weight(head) if can_prepack(head) else None

    def use_native_kernels(self, kernels: NativeKernels | None) -> None:
        """Norms, RoPE, the KV-cache write and decode attention through models/native_kernels.c, and
        bf16 linears that oneDNN did not pack (call prepack() first) through linear_kernels.c.

        None goes back to torch ops. Each kernel rounds where the torch path does; results differ
        only by the order of fp32 sums (and attention no longer rounds between its two matmuls).
        """
        for module in self.modules():
            if isinstance(module, (Attention, RMSNorm)):
                module.native = kernels
            elif isinstance(module, Linear):
                module.native = _bind_linear(kernels, module.weight, module.bias, module.packed_weight)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.native_head = _bind_linear(kernels, head, None, self.packed_head)
        for layer in self.layers:
            layer.native = _bind_layer(kernels, layer, self.tp)
        attention = TorchPagedAttention(kernels)
        self.use_attention(attention)
        self.native_stack = _bind_stack(kernels, self.layers, attention)

    def use_attention(self, attention: PagedAttention) -> None:
        """Every layer's attention through `attention` (one instance: it may share work across layers)."""
        if self.native_stack is not None and attention is not self.native_stack.attention:
            self.native_stack = None  # it runs the C decode attention, which this replaces
        for module in self.modules():
            if isinstance(module, Attention):
                module.attention = attention

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (0 = keys).

        num_kv_heads is this rank's share. Zeroed, not empty, though attention never reads a slot
        past a sequence's end (models/attention.py): no NaN bit patterns in a fresh pool.
        """
        c = self.config
        shape = (2, num_blocks, block_size, c.num_kv_heads // world_size_of(self.tp), c.head_dim)
        device = self.embed_tokens.weight.device
        return [torch.zeros(shape, dtype=c.dtype, device=device) for _ in range(c.num_layers)]

    def checkpoint_parts(self, name: str) -> list[CheckpointPart]:
        """The checkpoint tensors that make up parameter `name` on this rank, and the shard of each.

        Fused parameters concatenate their parts along dim 0 in the order listed.
        """
        local_shape = tuple(self.get_parameter(name).shape)
        return checkpoint_parts(self.config, name, local_shape, world_size_of(self.tp))
