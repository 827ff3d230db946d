"""FlexAttention block masks built straight from the paged cache's block tables, on the device.

NOTE: the layout. FlexAttention sees the whole KV pool as one sequence of slots, keys and values
[1, num_kv_heads, num_blocks * block_size, head_dim] (a view of the cache, no copy), and the KV block
size of the mask is the cache's block size, so the block lists of a sequence's queries are its
block-table entries themselves: nothing is gathered, and a kernel reads only the blocks listed.

- full blocks (every slot at or before the query's position): `full_kv_indices`; the kernel skips
  mask_mod there;
- partial blocks (the rest, up to the block of the query's own position): `kv_indices`; mask_mod
  decides per slot.

The mask_mod is exact on its own, because FlexAttention's eager path ignores the block lists and
applies it to the whole pool: a slot is visible iff its block sits in the query's sequence's table at
the slot's logical block index and its logical position is at most the query's. The logical index of
a pool block comes from one map [num_blocks] built per step: a block in use has a single logical
index, since blocks are shared (prefix caching) only by sequences with the same prefix, at the same
index. Unused blocks map to 0, which the ownership check rejects unless the block really is the
sequence's first.

Static-shape padding sequences break both rules and need neither: their table is all null block,
however long they are (a prefill bucket's last padding sequence can outgrow the table), so the block
counts are clamped to the table's width, and whatever their rows see is discarded. A real sequence
never sees the null block: at a logical index it does not use, its table holds the null block, but
that index is past its length.

Two query layouts:
- decode: batch = sequences, and the query heads of one KV group are the rows
  (q [num_seqs, num_kv_heads, group, head_dim], no enable_gqa): every KV block is read once per KV
  head, and FlexAttention may take its split-KV decoding kernel;
- prefill: the packed ragged queries in one batch row, each sequence's rows starting on a
  `q_block_size` boundary (padding rows repeat their sequence's last position), so every query block
  belongs to one sequence and lists that sequence's blocks only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask

# The rows of one query block; FlexAttention's Triton kernels need a multiple of 16 (tensor cores).
Q_BLOCK_SIZE = 16


class PrefillRows(NamedTuple):
    """Where the packed queries of a prefill step sit in the block-aligned layout."""

    block_mask: BlockMask
    rows: torch.Tensor  # int64 [sum(query_lens)] aligned row of each packed query
    num_rows: int  # rows of the aligned layout: a multiple of Q_BLOCK_SIZE


def logical_block_index(
    block_tables: torch.Tensor,  # int32 [num_seqs, width], padded with the null block
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    num_blocks: int,  # blocks in the pool
    block_size: int,
) -> torch.Tensor:
    """int32 [num_blocks]: the logical index of every block the step's sequences use (0 elsewhere)."""
    num_seqs, width = block_tables.shape
    cols = torch.arange(width, dtype=torch.int32, device=block_tables.device)  # [width]
    num_used = (seq_lens + block_size - 1) // block_size  # [num_seqs]
    # Table entries past a sequence's end (the null block) land in one spare slot, then are cut off.
    is_used = cols[None, :] < num_used[:, None]  # [num_seqs, width]
    target = torch.where(is_used, block_tables.long(), num_blocks)  # [num_seqs, width]
    index = torch.zeros(num_blocks + 1, dtype=torch.int32, device=block_tables.device)
    index.scatter_(0, target.flatten(), cols.expand(num_seqs, width).flatten())
    return index[:num_blocks]


def decode_block_mask(
    seq_lens: torch.Tensor,  # int32 [num_seqs] context length after this step
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    num_blocks: int,
    block_size: int,
    group: int,  # query heads per KV head: the rows of each sequence's single query block
) -> BlockMask:
    """Each sequence's one query (at seq_len - 1) over its own blocks; tensors only (graph-safe)."""
    num_seqs, width = block_tables.shape
    logical = logical_block_index(block_tables, seq_lens, num_blocks, block_size)  # [num_blocks]
    num_full = (seq_lens // block_size).clamp(max=width)  # [num_seqs] blocks wholly before the query
    num_partial = (num_full * block_size < seq_lens) & (num_full < width)  # [num_seqs] the query's own
    cols = torch.arange(width, device=block_tables.device)
    # [num_seqs, width] the table shifted left by num_full: the partial block first
    partial = block_tables.gather(1, (num_full[:, None] + cols).clamp(max=width - 1))
    seq_lens_long = seq_lens.long()

    def is_visible(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = kv_idx // block_size
        index = logical[block]
        is_owned = block_tables[b, index] == block
        return is_owned & (index * block_size + kv_idx % block_size < seq_lens_long[b])

    return BlockMask.from_kv_blocks(
        num_partial.to(torch.int32).view(num_seqs, 1, 1),
        partial.view(num_seqs, 1, 1, width),
        num_full.to(torch.int32).view(num_seqs, 1, 1),
        block_tables.view(num_seqs, 1, 1, width),
        BLOCK_SIZE=(Q_BLOCK_SIZE * -(-group // Q_BLOCK_SIZE), block_size),
        mask_mod=is_visible,
        seq_lengths=(group, num_blocks * block_size),
        compute_q_blocks=False,
    )


def prefill_block_mask(
    query_lens: list[int],  # host: new tokens per sequence, packed in this order
    seq_lens: list[int],  # host: context length per sequence after this step
    seq_lens_t: torch.Tensor,  # int32 [num_seqs] the same on the device
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    num_blocks: int,
    block_size: int,
) -> PrefillRows:
    """Packed ragged queries (decodes among them) over their sequences' blocks, causal.

    The per-query-block counts come from the host lists (prefill steps run eagerly) and cross to the
    device in one copy; the block lists themselves are gathered from the table on the device.
    """
    device = block_tables.device
    num_seqs, width = block_tables.shape
    q_len = torch.tensor(query_lens)  # [num_seqs]
    ctx_len = torch.tensor(seq_lens) - q_len  # [num_seqs] cached positions before this step's
    num_q_blocks = (q_len + Q_BLOCK_SIZE - 1) // Q_BLOCK_SIZE  # [num_seqs]
    first_q_block = num_q_blocks.cumsum(0) - num_q_blocks  # [num_seqs]
    total_q_blocks = int(num_q_blocks.sum())
    num_rows = total_q_blocks * Q_BLOCK_SIZE

    q_block_seq = torch.repeat_interleave(torch.arange(num_seqs), num_q_blocks)  # [total_q_blocks]
    local_block = torch.arange(total_q_blocks) - first_q_block[q_block_seq]
    first_pos = ctx_len[q_block_seq] + local_block * Q_BLOCK_SIZE
    last_pos = ctx_len[q_block_seq] + torch.minimum((local_block + 1) * Q_BLOCK_SIZE, q_len[q_block_seq]) - 1
    num_needed = (last_pos // block_size + 1).clamp(max=width)  # up to the block of the last query
    num_full = ((first_pos + 1) // block_size).clamp(max=num_needed)  # visible to every query
    num_partial = num_needed - num_full

    row_seq = q_block_seq.repeat_interleave(Q_BLOCK_SIZE)  # [num_rows]
    local_row = torch.arange(num_rows) - first_q_block[row_seq] * Q_BLOCK_SIZE
    row_pos = ctx_len[row_seq] + torch.minimum(local_row, q_len[row_seq] - 1)  # padding: the last query's
    token_seq = torch.repeat_interleave(torch.arange(num_seqs), q_len)  # [num_tokens]
    local_token = torch.arange(len(token_seq)) - (q_len.cumsum(0) - q_len)[token_seq]
    rows = first_q_block[token_seq] * Q_BLOCK_SIZE + local_token  # [num_tokens]

    # One host-to-device copy for everything the step's mask needs.
    host = torch.cat((q_block_seq, num_full, num_partial, row_seq, row_pos, rows))
    q_block_seq, num_full, num_partial, row_seq, row_pos, rows = host.to(device).split(
        [total_q_blocks] * 3 + [num_rows] * 2 + [len(rows)]
    )
    logical = logical_block_index(block_tables, seq_lens_t, num_blocks, block_size)
    tables = block_tables[q_block_seq]  # [total_q_blocks, width] each query block's sequence's table
    cols = torch.arange(width, device=device)
    partial = tables.gather(1, (num_full[:, None] + cols).clamp(max=width - 1))  # partial blocks first

    def is_visible(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = kv_idx // block_size
        index = logical[block]
        is_owned = block_tables[row_seq[q_idx], index] == block
        return is_owned & (index * block_size + kv_idx % block_size <= row_pos[q_idx])

    block_mask = BlockMask.from_kv_blocks(
        num_partial.to(torch.int32).view(1, 1, total_q_blocks),
        partial.view(1, 1, total_q_blocks, width),
        num_full.to(torch.int32).view(1, 1, total_q_blocks),
        tables.view(1, 1, total_q_blocks, width),
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=is_visible,
        seq_lengths=(num_rows, num_blocks * block_size),
        compute_q_blocks=False,
    )
    return PrefillRows(block_mask, rows, num_rows)
