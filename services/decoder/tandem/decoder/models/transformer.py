"""The decoder stack of Qwen3, Qwen2, Llama and Mistral; each family's file states only what differs.

Parameter names follow the Hugging Face checkpoints (minus the leading "model."), except that
q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj`: one GEMM each instead of three and
two. `checkpoint_parts` tells the loader which checkpoint tensors (and which shard of each) make up
each parameter. With a ParallelGroup the model holds this rank's shard only; where the collectives
go is described in `tensor_parallel.py`. Without one (a single rank) the forward is the plain model.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.torch_part import huge_pages
from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.models.attention import AttentionMetadata, PagedAttention, write_kv_cache
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.kernels import PLAIN, LayerKernels, ModelKernels
from tandem.decoder.models.kv_pool import KvPoolUnallocated, check_host_memory, out_of_memory
from tandem.decoder.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rotary,
    merge_prompt_embeds,
)
from tandem.decoder.models.linear import Linear
from tandem.decoder.models.lora import LayerLora, LoraStep
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tandem.decoder.models.tensor_parallel import (
    CheckpointPart,
    ParallelGroup,
    VocabParallelEmbedding,
    checkpoint_parts,
    gather_sequence,
    gather_vocab_logits,
    local_rows,
    row_parallel,
    rows_for_logits,
    world_size_of,
)
from tandem.decoder.models.torch_attention import TorchPagedAttention


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
        # Qwen2 biases q/k/v but not o_proj; Llama's attention_bias biases all four (models/config.py).
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # Qwen3 normalises each query and key head before RoPE; Llama does not.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if use_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if use_qk_norm else None
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
        lora: LayerLora | None = None,  # the step's adapters' deltas; None: no row is adapted
        kernels: LayerKernels = PLAIN,  # what the backend bound (models/kernels.py); PLAIN: torch ops
    ) -> torch.Tensor:
        x = gather_sequence(x, self.tp, sp)  # [num_tokens, hidden_size]
        qkv = (kernels.qkv or self.qkv_proj)(x)  # [num_tokens, q_size + 2 * kv_size]
        if lora is not None:
            qkv = lora.qkv_proj(x, qkv)
        q, k, v = (kernels.rope_cache or self.rope_and_cache)(qkv, cos, sin, attn, kv_cache)
        out = self.attention(q, k, v, kv_cache, attn, self.scale)  # [num_tokens, num_heads * head_dim]
        o_delta = None if lora is None else lora.o_proj
        o_proj = kernels.o or self.o_proj
        return row_parallel(o_proj, out, self.tp, sp, o_delta)  # [num_tokens or local_len, hidden_size]

    def rope_and_cache(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projected heads, normed (Qwen3) and rotated, with this step's keys and values written to
        the cache: q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        write_kv_cache(kv_cache, k, v, attn.slot_mapping)
        return q, k, v


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, use_qk_norm: bool, tp: ParallelGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, use_qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden_size], or this rank's [local_len, hidden_size] under SP
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        sp: bool = False,
        lora: LayerLora | None = None,
        kernels: LayerKernels = PLAIN,  # what the backend bound (models/kernels.py); PLAIN: torch ops
    ) -> torch.Tensor:
        if kernels.fused is not None:
            a = self.self_attn
            slots = None if lora is None else lora.slots  # int64 [num_tokens]
            return kernels.fused(h, cos, sin, attn, kv_cache, a.attention, a.scale, slots)
        # Norms and residual adds run on whatever rows this rank holds: its slice under SP.
        x = (kernels.input_norm or self.input_layernorm)(h)
        h = h + self.self_attn(x, cos, sin, attn, kv_cache, sp, lora, kernels)
        x = (kernels.post_norm or self.post_attention_layernorm)(h)
        return h + self.mlp(x, sp, lora, kernels.gate_up, kernels.down)  # same rows as h


def layer_lora(lora: LoraStep | None, index: int, kernels: LayerKernels) -> LayerLora | None:
    """Layer `index`'s deltas for the step: on the kernel bound for them, else LoraStep.layer's."""
    if lora is None or lora.slots is None:
        return None
    return lora.layer(index) if kernels.lora is None else kernels.lora(lora.slots)


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

    def forward(
        self,
        batch: ForwardBatch,  # the step's packed inputs (models/forward_batch.py)
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        kernels: ModelKernels | None = None,  # what a backend bound (models/kernels.py); None: torch ops
    ) -> torch.Tensor:
        """Runs one step and returns float32 logits [num_logits, vocab_size] at attn.logits_indices.

        With several ranks every rank returns the same logits. A step with any prefill runs
        sequence-parallel and needs its token count padded to a multiple of the world size.
        """
        h = self.hidden_states(batch, kv_caches, kernels)
        return self.compute_logits(h, kernels)  # [num_logits, vocab_size]

    def hidden_states(
        self,
        batch: ForwardBatch,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        kernels: ModelKernels | None = None,  # what a backend bound; None: torch ops
    ) -> torch.Tensor:
        """`forward` without the LM head: the final hidden rows [num_logits, hidden_size] at
        attn.logits_indices, for a caller that takes the logits of many rows a slice at a time."""
        sp = self.is_sequence_parallel(batch)
        h = self.layer_states(batch, kv_caches, sp, kernels)
        return self.final_rows(h, batch.attn, sp)  # [num_logits, hidden_size]

    def layer_states(
        self,
        batch: ForwardBatch,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        sp: bool = False,  # sequence parallel (is_sequence_parallel): this rank's slice in and out
        kernels: ModelKernels | None = None,  # what a backend bound; None: torch ops
    ) -> torch.Tensor:
        """The last layer's output at every position, before the final norm: [num_tokens, hidden_size],
        or this rank's [local_len, hidden_size] under SP."""
        h = self.embed(batch, sp)
        cos, sin = self.rotary(batch.positions, h.dtype)  # [num_tokens, 1, head_dim] each, for all layers
        attn, lora = batch.attn, batch.lora
        if kernels is None:
            return self.run_layers(h, cos, sin, attn, kv_caches, lora, None, sp)
        if kernels.walk is not None and not sp:
            return kernels.walk(self.run_layers, h, cos, sin, attn, kv_caches, lora, kernels.layers)
        return self.run_layers(h, cos, sin, attn, kv_caches, lora, kernels.layers, sp)

    def run_layers(
        self,
        h: torch.Tensor,  # [num_tokens, hidden_size], or this rank's [local_len, hidden_size] under SP
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        lora: LoraStep | None = None,  # each row's adapter; None: no adapters loaded
        layers: tuple[LayerKernels, ...] | None = None,  # each layer's bound kernels; None: torch ops
        sp: bool = False,
    ) -> torch.Tensor:
        """Every layer in order over h (the loop a walk kernel calls: models/kernels.py's LayerLoop)."""
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            bound = PLAIN if layers is None else layers[i]
            h = layer(h, cos, sin, attn, kv_cache, sp, layer_lora(lora, i, bound), bound)
        return h

    def is_sequence_parallel(self, batch: ForwardBatch) -> bool:
        """Whether this step runs sequence-parallel: several ranks and any prefill.

        Raises ValueError when such a step's token count is not padded to a multiple of the world size.
        """
        tp = self.tp
        sp = tp is not None and not batch.attn.is_decode_only
        if sp and batch.num_tokens % tp.world_size:
            raise ValueError(
                f"a sequence-parallel step needs num_tokens ({batch.num_tokens}) padded to a multiple "
                f"of the world size ({tp.world_size})"
            )
        return sp

    def embed(self, batch: ForwardBatch, sp: bool) -> torch.Tensor:
        """The first hidden rows: [num_tokens, hidden_size], or this rank's [local_len, ...] under SP."""
        h = self.embed_tokens(batch.input_ids, sp)
        # Every rank cuts the same window out of the per-position inputs, then merges on its slice.
        tp = self.tp
        embeds, is_token_ids = local_rows(batch.inputs_embeds, tp, sp), local_rows(batch.is_token_ids, tp, sp)
        return merge_prompt_embeds(h, embeds, is_token_ids)

    def final_rows(self, h: torch.Tensor, attn: AttentionMetadata, sp: bool) -> torch.Tensor:
        """The last layer's rows whose logits are wanted, normed: [num_logits, hidden_size].

        The norm is per row, so only those rows go through it and the head.
        """
        return self.norm(rows_for_logits(h, attn.logits_indices, self.tp, sp))

    @property
    def head_weight(self) -> torch.Tensor | QuantizedTensor:
        """[vocab_size / world_size, hidden_size]: lm_head's, or the tied embedding table (quantized
        when the model was loaded with quantized weights)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.qweight if isinstance(head, QuantizedLinear | QuantizedEmbedding) else head.weight

    def compute_logits(self, h: torch.Tensor, kernels: ModelKernels | None = None) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size] of final hidden rows h [num_rows, hidden_size].

        With several ranks a collective: every rank calls it with the same rows.
        """
        if kernels is not None and kernels.head is not None:
            return gather_vocab_logits(kernels.head(h), self.tp)
        weight = self.head_weight
        if isinstance(weight, QuantizedTensor):
            weight = weight.dequantize(h.dtype)
        return gather_vocab_logits(F.linear(h, weight), self.tp)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """int64 [num_rows]: each row's first largest logit (greedy decoding's pick)."""
        return logits.argmax(dim=-1)

    def use_attention(self, attention: PagedAttention) -> None:
        """Every layer's attention through `attention` (one instance: it may share work across layers)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.attention = attention

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (0 = keys).

        num_kv_heads is this rank's share. Zeroed, not empty, though attention never reads a slot
        past a sequence's end (models/attention.py): no NaN bit patterns in a fresh pool. Raises
        KvPoolUnallocated (with the bytes asked) when the memory is not there, or a host pool is
        larger than the memory this process may take (kv_pool.check_host_memory).
        """
        c = self.config
        shape = (2, num_blocks, block_size, c.num_kv_heads // world_size_of(self.tp), c.head_dim)
        device = self.device
        num_bytes = c.num_layers * math.prod(shape) * c.dtype.itemsize
        if device.type == "cpu":
            check_host_memory(num_blocks, num_bytes, None if self.tp is None else self.tp.rank)
        try:
            if device.type == "cpu":
                # One pool in 2 MiB pages (common/torch_part/huge_pages.py: a step's scattered block reads),
                # each layer's cache a contiguous view of it.
                pool = huge_pages.zeros(c.num_layers * math.prod(shape), c.dtype)
                layers = pool.view(c.num_layers, *shape)
                return [
                    layers[i] for i in range(c.num_layers)
                ]  # not unbind: its views refuse in-place writes
            return [torch.zeros(shape, dtype=c.dtype, device=device) for _ in range(c.num_layers)]
        except (OSError, RuntimeError, MemoryError, OverflowError) as error:
            # Only the allocation's own refusals: mmap's ENOMEM, or a size past what it maps at all;
            # torch's allocators (OutOfMemoryError, the CPU allocator's RuntimeError). Anything else (a
            # CUDA error left by an earlier kernel) is a fault of its own, not a size to give less.
            if not out_of_memory(error):
                raise
            raise KvPoolUnallocated(num_blocks, num_bytes, str(error)) from error

    def checkpoint_parts(self, name: str) -> list[CheckpointPart]:
        """The checkpoint tensors that make up parameter `name` on this rank, and the shard of each.

        Fused parameters concatenate their parts along dim 0 in the order listed.
        """
        local_shape = tuple(self.get_parameter(name).shape)
        return checkpoint_parts(self.config, name, local_shape, world_size_of(self.tp))
