"""The CUDA implementation of paged attention: FlexAttention over the paged cache, SDPA for fresh prompts.

- decode: one FlexAttention call per layer over block masks built from the block tables
  (`flex_block_mask.py`): the kernel reads each sequence's blocks where they lie, nothing is gathered,
  and every step is tensors only, so a decode bucket captures as one CUDA graph;
- prefill: a step whose sequences are all fresh prompts of one length (no cached prefix) is one SDPA
  call on this step's own keys and values, in the model dtype (FlashAttention on the GPU); any other
  step (cached prefixes, ragged lengths, decodes mixed in) is one FlexAttention call over the
  block-aligned packed queries.

bf16 in, fp32 accumulation inside the kernels, nothing upcast in memory. The same code runs on CPU with
FlexAttention's eager path, which is what `make test` compares against the C kernels and a dense
reference; on CUDA `flex` is the compiled function (`backends/cuda_attention.py`).

NOTE: stale slots (models/attention.py). The kernels skip unlisted blocks, but a listed partial block
is read whole, and a probability of zero times a NaN value is NaN. So before attending, every
sequence's last block is cleared past the sequence's end (slots no one has written since the block
was handed over): a fixed-shape write of zeros, where the slots still in use are redirected to the
null block's (which only padding sequences read), so it captures in a graph like the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tandem.client.errors import ConfigError
from tandem.decoder.models.attention import AttentionMetadata, PagedAttention
from tandem.decoder.models.flex_block_mask import (
    Q_BLOCK_SIZE,
    decode_block_mask,
    prefill_block_mask,
)

NULL_BLOCK_ID = 0  # the engine's scratch block, reserved by engine/scheduling/kv_cache.py

FlexFn = Callable[..., torch.Tensor]  # flex_attention or a compiled copy of it


class FlexStep(NamedTuple):
    """What every layer of one step shares: built once per step, used by all layers."""

    block_mask: BlockMask
    stale_slots: torch.Tensor  # int64 [num_seqs * block_size] slots to zero before attending
    rows: torch.Tensor | None  # prefill: int64 [sum(query_lens)] aligned row of each packed query
    num_rows: int  # prefill: rows of the aligned layout; decode: 0


class FlexPagedAttention(PagedAttention):
    """FlexAttention with block masks from the block tables; `flex` is eager on CPU, compiled on CUDA."""

    def __init__(self, flex: FlexFn = flex_attention) -> None:
        self.flex = flex
        # The last step's shared work, keyed by its AttentionMetadata object: the first layer builds
        # it, the others reuse it. Graphs build it in every layer instead: a compiled one holds no
        # Python state (and the compiler merges the copies, which read the same inputs), and a CUDA
        # graph being captured must record the building, not reuse what a warmup call left here.
        self._last: tuple[AttentionMetadata, FlexStep] | None = None

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        # The Triton kernels tile keys by the mask's KV block, which is the cache's block.
        if block_size < 16 or block_size & (block_size - 1):
            raise ConfigError(
                "block_size", f"must be a power of two >= 16 for FlexAttention (cuda), got {block_size}"
            )

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        step = self._step(attn, kv_cache, lambda: self._decode_step(attn, kv_cache, group))
        keys, values = _clean_pool(kv_cache, step.stale_slots)
        # The query heads of one KV group are the rows of one query block: [num_seqs, kv, group, hd].
        rows = q.view(num_seqs, num_kv_heads, group, head_dim)
        out = self._attend(rows, keys, values, step.block_mask, scale, enable_gqa=False)
        return out.reshape(num_seqs, num_heads * head_dim)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if _is_uniform_fresh(attn):
            return _fresh_prompts(q, k, v, len(attn.query_lens), scale)
        step = self._step(attn, kv_cache, lambda: self._prefill_step(attn, kv_cache))
        assert step.rows is not None
        keys, values = _clean_pool(kv_cache, step.stale_slots)
        aligned = q.new_zeros(step.num_rows, num_heads, head_dim).index_copy_(0, step.rows, q)
        out = self._attend(
            aligned.transpose(0, 1)[None], keys, values, step.block_mask, scale, enable_gqa=True
        )
        return out[0].transpose(0, 1).index_select(0, step.rows).reshape(num_tokens, num_heads * head_dim)

    def _attend(
        self,
        q: torch.Tensor,  # [batch, heads, rows, head_dim]
        keys: torch.Tensor,  # [1, num_kv_heads, num_slots, head_dim]
        values: torch.Tensor,  # [1, num_kv_heads, num_slots, head_dim]
        block_mask: BlockMask,
        scale: float,
        enable_gqa: bool,
    ) -> torch.Tensor:  # [batch, heads, rows, head_dim]
        # Inside a compiled graph the plain function is what the compiler lowers to its kernel.
        flex = flex_attention if torch.compiler.is_compiling() else self.flex
        kv_block = block_mask.BLOCK_SIZE[1]
        # The kernels' tiles must divide the mask's blocks (whose KV side is the cache's block size).
        options = {"BLOCK_M": Q_BLOCK_SIZE, "BLOCK_N": kv_block}
        return flex(
            q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=options
        )

    def _step(
        self, attn: AttentionMetadata, kv_cache: torch.Tensor, build: Callable[[], FlexStep]
    ) -> FlexStep:
        if torch.compiler.is_compiling() or (kv_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
            return build()
        if self._last is None or self._last[0] is not attn:
            self._last = (attn, build())
        return self._last[1]

    def _decode_step(self, attn: AttentionMetadata, kv_cache: torch.Tensor, group: int) -> FlexStep:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        block_mask = decode_block_mask(attn.seq_lens_t, attn.block_tables, num_blocks, block_size, group)
        return FlexStep(block_mask, _stale_slots(attn, block_size), None, 0)

    def _prefill_step(self, attn: AttentionMetadata, kv_cache: torch.Tensor) -> FlexStep:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        prefill = prefill_block_mask(
            attn.query_lens, attn.seq_lens, attn.seq_lens_t, attn.block_tables, num_blocks, block_size
        )
        return FlexStep(prefill.block_mask, _stale_slots(attn, block_size), prefill.rows, prefill.num_rows)


def _is_uniform_fresh(attn: AttentionMetadata) -> bool:
    """Every sequence is a whole prompt (nothing cached) and all have one length."""
    first = attn.query_lens[0]
    return all(q == s == first for q, s in zip(attn.query_lens, attn.seq_lens, strict=True))


def _fresh_prompts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float
) -> torch.Tensor:
    """Causal SDPA over this step's own keys: [num_seqs * length, heads, hd] -> [num_tokens, heads * hd]."""
    num_tokens, num_heads, head_dim = q.shape
    length = num_tokens // num_seqs
    q_seqs = q.view(num_seqs, length, num_heads, head_dim).transpose(1, 2)  # [seqs, heads, length, hd]
    k_seqs = k.view(num_seqs, length, -1, head_dim).transpose(1, 2)  # [seqs, kv_heads, length, hd]
    v_seqs = v.view(num_seqs, length, -1, head_dim).transpose(1, 2)  # [seqs, kv_heads, length, hd]
    out = F.scaled_dot_product_attention(q_seqs, k_seqs, v_seqs, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(num_tokens, num_heads * head_dim)


def _stale_slots(attn: AttentionMetadata, block_size: int) -> torch.Tensor:
    """int64 [num_seqs * block_size]: each sequence's last-block slots past its end, else a null slot."""
    seq_lens = attn.seq_lens_t.long()  # [num_seqs]
    # [num_seqs]; clamped for static padding sequences, which may outgrow their (all null) table
    last_index = ((seq_lens + block_size - 1) // block_size - 1).clamp(max=attn.block_tables.shape[1] - 1)
    last_block = attn.block_tables.long().gather(1, last_index[:, None])  # [num_seqs, 1]
    offsets = torch.arange(block_size, device=seq_lens.device)  # [block_size]
    is_stale = offsets[None, :] >= (seq_lens - last_index * block_size)[:, None]  # [num_seqs, block_size]
    slots = torch.where(is_stale, last_block * block_size + offsets, NULL_BLOCK_ID * block_size + offsets)
    return slots.flatten()


def _clean_pool(kv_cache: torch.Tensor, stale_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroes the stale slots, then views the pool as FlexAttention's keys and values.

    Returns two [1, num_kv_heads, num_slots, head_dim] views of kv_cache (no copy).
    """
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, num_kv_heads, head_dim]
    slots.index_fill_(1, stale_slots, 0)
    return slots[0].transpose(0, 1)[None], slots[1].transpose(0, 1)[None]
