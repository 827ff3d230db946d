"""The attention interface: one call per layer, prefill and decode alike, over the paged KV cache.

NOTE: the invariant. Each step's keys and values are written into the cache first (through
`slot_mapping`), then every query attends to its own sequence's cache only: the query at packed
offset j of a sequence with `query_len` new tokens and `seq_len` total sits at position
`seq_len - query_len + j` and sees the keys at positions up to and including its own. The cache is
the single source of keys, so chunked prefill and decode are the same computation.

Block 0 of the pool is the engine's scratch "null block": padding tokens write there and padded
block-table entries point there, so keys are masked by `seq_lens`, never by trusting the table.

NOTE: stale slots. A slot past a sequence's end holds whatever its last owner or a padding token
wrote, NaN and inf included (a request whose values overflow the model dtype leaves them behind).
No implementation lets such a slot reach the output; each one says how it keeps that promise.

Model code calls a `PagedAttention` and never asks which device it runs on. One implementation per
backend, chosen by `backends/backend.py`: `torch_attention.TorchPagedAttention` (torch ops: the default
of a freshly built model on any device; the CPU executor puts its C kernel in front of it) and
`flex_attention.FlexPagedAttention` (CUDA: FlexAttention over block masks built from the block
tables, SDPA for uniform fresh prompts; it runs on CPU too, where the tests compare it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's tokens sit in the packed batch and in the paged KV cache, for one step."""

    query_lens: list[int]  # host: tokens scheduled this step per sequence (packed in this order)
    seq_lens: list[int]  # host: context length per sequence after this step (cached + scheduled)
    seq_lens_t: torch.Tensor  # int32 [num_seqs] same as seq_lens, on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens] KV slot (block_id * block_size + offset) per new token
    # int32 [num_seqs, max_blocks_per_seq] block ids of each sequence, padded with 0. Its width is a
    # static-shape bucket: gathering implementations pay for all of it, so keep it to what the
    # batch's longest sequence needs.
    block_tables: torch.Tensor
    logits_indices: torch.Tensor  # int64 [num_logits] packed positions whose logits are returned
    # int32 [num_seqs + 1] cumulative query_lens (0 first), on the device: where each sequence's queries
    # start in the packed batch, for implementations whose prefill reads no host list (XLA's graphs).
    # None where no implementation needs it (the batch was built without it).
    query_start_loc: torch.Tensor | None = None
    is_decode_only: bool = field(init=False)  # derived: every sequence has exactly one query this step

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_decode_only", all(n == 1 for n in self.query_lens))


def write_kv_cache(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores this step's keys and values at their slots.

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads,
    head_dim]; slot_mapping: int64 [num_tokens].

    One in-place write of the cache tensor itself, never of a view of it: a graph compiler then
    updates the cache's buffer in place (XLA aliases an input updated in place to its output; an
    update through a view it copies whole).
    """
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [num_tokens] each
    is_value = torch.zeros_like(slot_mapping)  # [num_tokens]: 0 selects the keys' half of the cache
    with torch.no_grad():  # the cache is state, never part of a graph to differentiate
        kv_cache.index_put_(
            (torch.cat((is_value, is_value + 1)), torch.cat((blocks, blocks)), torch.cat((offsets, offsets))),
            torch.cat((k, v)),  # [2 * num_tokens, num_kv_heads, head_dim]
        )


class PagedAttention(ABC):
    """Attention of one layer over the paged cache; this step's keys and values are already written.

    Subclasses implement `decode` (one query per sequence) and `prefill` (packed ragged queries, some
    sequences possibly decoding in the same step); `__call__` picks one and pads the output.
    """

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        """Raises ConfigError on block_size, naming the limit, when this implementation cannot take KV
        blocks this size: the command line says it as one line naming --block-size, exit 2."""
        return None  # torch ops take any size

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim] as written; None on decode-only steps
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim] as written; None on decode-only steps
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Returns [num_tokens, num_heads * head_dim] in q's dtype.

        Tokens past sum(query_lens) are padding (sequence-parallel steps pad the token count); their
        rows are zero.
        """
        num_tokens = q.shape[0]
        if attn.is_decode_only:
            out = self.decode(q[: len(attn.query_lens)], kv_cache, attn, scale)
        else:
            if k is None or v is None:
                raise ValueError("a step with any prefill needs this step's keys and values (k, v)")
            num_real = sum(attn.query_lens)
            out = self.prefill(q[:num_real], k[:num_real], v[:num_real], kv_cache, attn, scale)
        if out.shape[0] < num_tokens:
            out = torch.cat((out, out.new_zeros(num_tokens - out.shape[0], out.shape[1])))
        return out

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_seqs, num_heads * head_dim] in q's dtype
        """Reads lengths from `attn.seq_lens_t` only: a traced decode bucket has no host lists."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,  # [sum(query_lens), num_heads, head_dim]
        k: torch.Tensor,  # [sum(query_lens), num_kv_heads, head_dim]
        v: torch.Tensor,  # [sum(query_lens), num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [sum(query_lens), num_heads * head_dim] in q's dtype
        """May use the host lists `attn.query_lens` and `attn.seq_lens`: prefill steps run eagerly."""
