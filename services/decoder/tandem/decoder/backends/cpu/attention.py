"""The CPU executor's paged attention: the C decode kernel where it takes the shapes, torch ops elsewhere.

The C kernel reads the paged cache in place (no gathered copy of the context) and reads positions
below `seq_len` only, so stale slots never reach it (models/attention.py, the NOTE on stale slots).
A decode-only step runs through it whenever the shapes fit its limits (`limits.fits`, csrc/limits.h).
A step with any prefill runs through it too, one query row per token, when every context is short
(the limits' `prefill_max_context`): a sequence's rows are runs of consecutive positions that read
each key block once, which costs rows x context where SDPA tiles the causal triangle; past the
limit SDPA wins. A prefilled position then gets the bits a decode step gives the same position, so a
recompute after preemption matches. On AVX512-BF16 builds a bf16 cache with head_dim a multiple of
`tiled_head_dim` (64) goes to the tiled kernel (csrc/attention_tiles.c), which is faster than SDPA at
every length: there is no context limit then.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.decoder.backends.cpu.kernels import DTYPE_CODES
from tandem.decoder.backends.cpu.limits import Limits, fits
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.torch_attention import TorchPagedAttention, prefill_attention


class CpuPagedAttention(TorchPagedAttention):
    """Torch ops, with the C kernel (`ops.decode_attention`, one build's custom op) in front."""

    def __init__(self, ops: Any, limits: Limits, tiled: bool = False) -> None:
        self.ops = ops  # torch.ops.tandem_<level> (ops.register)
        self.limits = limits  # the same build's (Kernels.limits)
        # Whether the build's tiled kernel takes the model's caches (AVX512-BF16, faster than SDPA at
        # every length): a step with prefill then attends through the kernel at any context.
        self.tiled = tiled
        # The last sizes (query heads, cache shape) that fit the build's limits.
        self._fitting: tuple[int, torch.Size] | None = None
        # The last step's rows as sequences, computed by its first layer for all of them (one instance
        # serves every layer): (metadata, tables, lengths).
        self._rows: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if self.takes(q, kv_cache):
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
            fits(self.limits, prefill_context=longest, tiled=self.tiled)
            and longest <= attn.block_tables.shape[1] * kv_cache.shape[2]
            and self.takes(q, kv_cache)
        ):
            rows = self._rows
            if rows is None or rows[0] is not attn:
                rows = self._rows = (attn, *rows_as_sequences(attn))
            _, tables, row_lens = rows
            return self.ops.decode_attention(q, kv_cache, tables, row_lens, scale)
        return prefill_attention(q, kv_cache, attn, scale, k, v)

    def takes(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the C kernel takes these shapes (the build's limits) and tensors (one dtype it has,
        on the CPU, the cache contiguous)."""
        sizes = (q.shape[1], kv_cache.shape)
        if sizes != self._fitting:  # every layer of a model asks of the same sizes: once, then compared
            _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
            if not fits(
                self.limits,
                head_dim=head_dim,
                num_heads=q.shape[1],
                num_kv_heads=num_kv_heads,
                block_size=block_size,
            ):
                return False
            self._fitting = sizes
        return (
            q.dtype == kv_cache.dtype
            and q.dtype in DTYPE_CODES
            and q.device.type == "cpu"
            and kv_cache.is_contiguous()
        )


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
