"""The CPU executor's paged attention: the C decode kernel where it takes the shapes, torch ops elsewhere.

The C kernel reads the paged cache in place (no gathered copy of the context) and reads positions
below `seq_len` only, so stale slots never reach it (models/attention.py, the NOTE on stale slots).
A decode-only step runs through it whenever the shapes fit its limits (`limits.fits`, csrc/limits.h).

NOTE: which rows of a step with prefill take the kernel. A sequence with one query (a decode, or one
of speculation's verification rows, each a sequence of its own) always does, as in a decode-only
step: its row gets the bits it gets there whatever shares its step, so a request decoding beside a
neighbour's long prompt chunk, and its verification rows, which land in other steps than its plain
decode rows would, get the logprobs of plain decode steps. A prompt chunk (more than one query)
takes it too, one query row per position, when its own context is short (the limits'
`prefill_max_context`): a chunk's rows are runs of consecutive positions that read each key block
once, which costs rows x context where SDPA tiles the causal triangle; a chunk past the limit goes
to SDPA (torch_attention.prefill_attention) and every other row stays on the kernel, each part's
outputs written back to its rows. Each chunk's own context decides, not the step's longest, so a
prompt's logprobs do not depend on which prompts share its step: when the longest decided, a
200-token prompt beside a 700-token one got other float32 logprobs than alone at 66 of its 199
positions. The price is small: 64 new positions at context 64 beside 512 at 700 (SmolLM2's heads,
one thread, a loaded 2-core AMD EPYC, thread CPU time) cost a layer 14.8-16.5 ms of attention with
both chunks on SDPA, 15.1-17.2 ms split, in float32 (bf16: 14.27 against 14.30); the short chunk
alone takes 0.13 ms on the kernel, 0.18 ms on SDPA. A prefilled position on the kernel gets the bits
a decode step gives the same position, so a recompute after preemption matches. On AVX512-BF16
builds a bf16 cache with head_dim a multiple of `tiled_head_dim` (64) goes to the tiled kernel
(csrc/attention_tiles.c), which is faster than SDPA at every length: there is no context limit then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.decoder.backends.cpu.kernels import DTYPE_CODES
from tandem.decoder.backends.cpu.limits import Limits, fits
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.torch_attention import TorchPagedAttention, prefill_attention

# A part's rows in the step's packing: a slice where they are one run, else int64 [num_part_rows].
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class StepRows:
    """Which rows of one step with prefill attend on the kernel and which on SDPA (the NOTE above)."""

    attn: AttentionMetadata  # the step's metadata: its first layer works this out for every layer
    kernel_rows: Rows  # the rows on the kernel, in packed order
    tables: torch.Tensor  # int32 [num_kernel_rows, max_blocks] each kernel row's block table
    row_lens: torch.Tensor  # int32 [num_kernel_rows] the context each kernel row sees, its own included
    sdpa_rows: Rows  # the rows of the sequences on SDPA, in packed order
    sdpa_attn: AttentionMetadata | None  # those sequences as a step of their own; None: none
    # The packing as runs of one part's rows, in order: (on the kernel, number of rows).
    runs: tuple[tuple[bool, int], ...]


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
        # The last step with prefill's rows (one instance serves every layer).
        self._rows: StepRows | None = None

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
        if not self.takes(q, kv_cache):
            return prefill_attention(q, kv_cache, attn, scale, k, v)
        rows = self._rows
        if rows is None or rows.attn is not attn:
            rows = self._rows = self.step_rows(attn, kv_cache.shape[2])
        if rows.sdpa_attn is None:
            return self.ops.decode_attention(q, kv_cache, rows.tables, rows.row_lens, scale)
        if rows.row_lens.numel() == 0:
            return prefill_attention(q, kv_cache, attn, scale, k, v)
        on_kernel = self.ops.decode_attention(
            _take(q, rows.kernel_rows), kv_cache, rows.tables, rows.row_lens, scale
        )
        sdpa = rows.sdpa_rows
        on_sdpa = prefill_attention(
            _take(q, sdpa), kv_cache, rows.sdpa_attn, scale, _take(k, sdpa), _take(v, sdpa)
        )
        pieces, taken = [], {True: 0, False: 0}
        for is_kernel, n in rows.runs:  # back in packed order: a cat of slices, cheaper than a scatter
            part = on_kernel if is_kernel else on_sdpa
            pieces.append(part[taken[is_kernel] : taken[is_kernel] + n])
            taken[is_kernel] += n
        return torch.cat(pieces)  # [num_rows, num_heads * head_dim]

    def step_rows(self, attn: AttentionMetadata, block_size: int) -> StepRows:
        """The step's rows on the kernel and on SDPA, by the NOTE above.

        A sequence longer than its table stays on SDPA: a static-shape padding sequence, whose
        one-block table is shorter than it (it attends only to its own fresh keys, which SDPA needs no
        table for; the kernel reads keys through the table)."""
        capacity = attn.block_tables.shape[1] * block_size
        query_lens, seq_lens = attn.query_lens, attn.seq_lens
        is_on_kernel = [
            n <= capacity and (q == 1 or bool(fits(self.limits, prefill_context=n, tiled=self.tiled)))
            for q, n in zip(query_lens, seq_lens, strict=True)
        ]
        tables, row_lens = rows_as_sequences(attn)
        num_rows = len(row_lens)
        if all(is_on_kernel):
            return StepRows(
                attn, slice(0, num_rows), tables, row_lens, slice(0, 0), None, ((True, num_rows),)
            )
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        runs: list[tuple[bool, int]] = []
        for on, n in zip(is_on_kernel, query_lens, strict=True):
            if runs and runs[-1][0] == on:
                runs[-1] = (on, runs[-1][1] + n)
            else:
                runs.append((on, n))
        kernel_rows = _rows_of([i for i, on in enumerate(is_on_kernel) if on], starts)
        sdpa_seqs = [i for i, on in enumerate(is_on_kernel) if not on]
        sdpa_rows = _rows_of(sdpa_seqs, starts)
        index = torch.tensor(sdpa_seqs, dtype=torch.int64)
        sdpa_attn = AttentionMetadata(
            query_lens=[query_lens[i] for i in sdpa_seqs],
            seq_lens=[seq_lens[i] for i in sdpa_seqs],
            seq_lens_t=attn.seq_lens_t.index_select(0, index),
            slot_mapping=_take(attn.slot_mapping, sdpa_rows),
            block_tables=attn.block_tables.index_select(0, index),
            logits_indices=attn.logits_indices.new_empty(0),  # the logits rows are the whole step's
        )
        return StepRows(
            attn,
            kernel_rows,
            _take(tables, kernel_rows),
            _take(row_lens, kernel_rows),
            sdpa_rows,
            sdpa_attn,
            tuple(runs),
        )

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


def _rows_of(seqs: list[int], starts: list[int]) -> Rows:
    """The packed rows of these sequences (starts: each sequence's first row, then the step's row
    count): a slice where they are one run, so that taking them copies nothing."""
    rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64)


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """x's rows (dim 0): a view of a slice, an index_select's copy of a tensor."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


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
