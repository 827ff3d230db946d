"""A step that mixes decode or verify rows with a long prefill chunk, run as two parts so that each row
takes its own kind's kernels.

NOTE: why a split is exact. Where the measured choice gives prefill chunks a kernel of their own
(oneDNN, which orders a row's sums by the row count, or AMX tiles only from `prefill_rows` rows on;
kernel_choice.py), a decode or verify row sharing a step with such a chunk would otherwise ride in a
call of many rows and get that kernel's bits, not the bits it gets alone. Sequences never see each
other inside a step (each attends to its own cache only, and this step's keys are written before
anyone reads them), so the step's sequences can run as two smaller steps over the same cache: the
sequences with more than one query (prompt chunks) when they hold `prefill_rows` rows or more, and
every other one (decode and verification rows, one query each: fewer rows than `prefill_rows`, so
their calls stay on the exact kernels). The layers' outputs go back to their packed rows; the logits
rows are then picked from the whole step as before. The cost: the decode part reads every weight a
second time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.lora import LoraStep

# The executor's layers over one part: (h, cos, sin, attn, kv_caches, is_prefill, lora) -> h.
Layers = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor], bool, LoraStep | None],
    torch.Tensor,
]


@dataclass(frozen=True)
class StepPart:
    """Some of a step's sequences, as a step of their own."""

    rows: torch.Tensor  # int64 [num_rows] their positions' rows in the step's packing
    attn: AttentionMetadata  # their metadata alone (no logits rows: those are picked from the whole step)
    is_prefill: bool  # the prompt chunks' part: calls of prefill_rows rows or more


def split_step(attn: AttentionMetadata, num_tokens: int, prefill_rows: int) -> list[StepPart] | None:
    """The step's parts, prompt chunks first; None when it runs whole (its prompt chunks hold fewer than
    prefill_rows rows, or it has padding rows past its sequences)."""
    query_lens = attn.query_lens
    if sum(query_lens) != num_tokens:
        return None
    chunk_seqs = [i for i, n in enumerate(query_lens) if n > 1]
    if sum(query_lens[i] for i in chunk_seqs) < prefill_rows:
        return None
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    other_seqs = [i for i, n in enumerate(query_lens) if n <= 1]
    parts = [_part(attn, chunk_seqs, starts, True)]
    if other_seqs:
        parts.append(_part(attn, other_seqs, starts, False))
    return parts


def _part(attn: AttentionMetadata, seqs: list[int], starts: list[int], is_prefill: bool) -> StepPart:
    rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], dtype=torch.int64)
    index = torch.tensor(seqs, dtype=torch.int64)
    metadata = AttentionMetadata(
        query_lens=[attn.query_lens[i] for i in seqs],
        seq_lens=[attn.seq_lens[i] for i in seqs],
        seq_lens_t=attn.seq_lens_t.index_select(0, index),
        slot_mapping=attn.slot_mapping.index_select(0, rows),
        block_tables=attn.block_tables.index_select(0, index),
        logits_indices=attn.logits_indices.new_empty(0),
    )
    return StepPart(rows, metadata, is_prefill)


def run_parts(
    parts: list[StepPart],
    h: torch.Tensor,  # [num_tokens, hidden] the step's first hidden rows
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]
    kv_caches: list[torch.Tensor],  # per layer
    layers: Layers,
    lora: LoraStep | None = None,  # the whole step's adapters
) -> torch.Tensor:
    """The last layer's rows [num_tokens, hidden] of the whole step, each part run on its own."""
    out = torch.empty_like(h)
    for part in parts:
        rows = part.rows
        out[rows] = layers(
            h[rows], cos[rows], sin[rows], part.attn, kv_caches, part.is_prefill, _part_lora(lora, rows)
        )
    return out


def _part_lora(lora: LoraStep | None, rows: torch.Tensor) -> LoraStep | None:
    """A part's own rows' adapters; a part without an adapted row runs the plain calls, as any step."""
    if lora is None or lora.slots is None:
        return None
    slots = lora.slots.index_select(0, rows)  # int64 [num_rows]
    return LoraStep(lora.table, slots if bool((slots >= 0).any()) else None)
