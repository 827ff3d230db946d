"""The CPU executor's paged attention: the C decode kernel where it takes the shapes, torch ops elsewhere.

The C kernel reads the paged cache in place (no gathered copy of the context) and reads positions
below `seq_len` only, so stale slots never reach it (models/attention.py, the NOTE on stale slots).
A decode-only step runs through it whenever the shapes fit its limits. A step with any prefill runs
through it too, one query row per token, when every context is short (PREFILL_MAX_CONTEXT): a
sequence's rows are runs of consecutive positions that read each key block once, which costs
rows x context where SDPA tiles the causal triangle; past the limit SDPA wins. A prefilled position
then gets the bits a decode step gives the same position, so a recompute after preemption matches.
On AVX512-BF16 builds a bf16 cache with head_dim a multiple of 64 goes to the tiled kernel
(csrc/attention_tiles.c), which is faster than SDPA at every length: there is no limit then.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.decoder.backends.cpu.kernels import DTYPE_CODES, MAX_BLOCK_SIZE, MAX_GROUP, MAX_HEAD_DIM
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.torch_attention import TorchPagedAttention, prefill_attention

# Longest context for which a step with prefill attends through the C decode kernel (the crossover
# with SDPA measured on SmolLM2's shapes: docs/PERFORMANCE.md).
PREFILL_MAX_CONTEXT = 640


def fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these shapes and dtypes (its scratch limits, one dtype)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    return (
        head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK_SIZE
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and q.dtype == kv_cache.dtype
        and q.dtype in DTYPE_CODES
        and q.device.type == "cpu"
        and kv_cache.is_contiguous()
    )


class CpuPagedAttention(TorchPagedAttention):
    """Torch ops, with the C kernel (`ops.decode_attention`, one build's custom op) in front."""

    def __init__(self, ops: Any, prefill_max_context: int | None = PREFILL_MAX_CONTEXT) -> None:
        self.ops = ops  # torch.ops.tandem_<level> (ops.register)
        # Longest context a step with prefill attends through the kernel; None: any (the tiled kernel
        # of AVX512-BF16 builds, faster than SDPA at every length).
        self.prefill_max_context = prefill_max_context
        # The last step's rows as sequences, computed by its first layer for all of them (one instance
        # serves every layer): (metadata, tables, lengths).
        self._rows: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if fits(q, kv_cache):
            return self.ops.decode_attention(q, kv_cache, attn.block_tables, attn.seq_lens_t, scale)
        return super().decode(q, kv_cache, attn, scale)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # Every context within its table too: a static-shape padding sequence is longer than its
        # one-block table (it attends only to its own fresh keys, which SDPA needs no table for).
        longest = max(attn.seq_lens)
        if (
            (self.prefill_max_context is None or longest <= self.prefill_max_context)
            and longest <= attn.block_tables.shape[1] * kv_cache.shape[2]
            and fits(q, kv_cache)
        ):
            rows = self._rows
            if rows is None or rows[0] is not attn:
                rows = self._rows = (attn, *rows_as_sequences(attn))
            _, tables, row_lens = rows
            return self.ops.decode_attention(q, kv_cache, tables, row_lens, scale)
        return prefill_attention(q, kv_cache, attn, scale, k, v)


def rows_as_sequences(attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row of the step as a one-query sequence: its sequence's block table, and the
    context it sees (query j of a sequence sits at position seq_len - query_len + j, and sees it).

    Returns int32 [num_rows, max_blocks] and int32 [num_rows]."""
    device = attn.block_tables.device
    counts = torch.tensor(attn.query_lens, device=device)  # [num_seqs]
    num_rows = sum(attn.query_lens)
    first = attn.seq_lens_t.long() - counts + 1  # [num_seqs] the context of each sequence's first row
    offsets = torch.arange(num_rows, device=device) - torch.repeat_interleave(
        counts.cumsum(0) - counts, counts, output_size=num_rows
    )  # [num_rows] j within its sequence
    row_lens = torch.repeat_interleave(first, counts, output_size=num_rows) + offsets
    tables = attn.block_tables.repeat_interleave(counts, dim=0, output_size=num_rows)
    return tables, row_lens.to(torch.int32)
