"""Tensor and sequence parallelism as the model layers see it: shards, and where the collectives go.

NOTE: the layout (Megatron-style TP + SP, as NxD Inference runs context encoding). With `sp` (a step
with any prefill, its token count padded to a multiple of the world size) the residual stream lives
in sequence slices: rank r holds rows [r * local_len, (r + 1) * local_len). Each column-parallel block
(QKV, gate/up) starts with an all-gather along the sequence, each row-parallel one (o_proj,
down_proj) ends with a reduce-scatter back to slices. Decode-only steps run plain TP: the residual
stream is replicated and each row-parallel output is all-reduced. The embedding is vocab-parallel
(each rank looks up the ids in its vocabulary range, zeros elsewhere; the reduce-scatter or
all-reduce sums the one non-zero row exactly), and so is the LM head (logits all-gathered on vocab).

Every helper is the identity (or the plain layer) when `tp` is None, so one rank pays nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.linear import Projection


class ParallelGroup(Protocol):
    """What the layers need of their rank's group; the decoder passes `distributed.parallel.ParallelContext`.

    Declared here, not imported, so that models/ depends on nothing else in the decoder.
    """

    rank: int  # this rank, 0-based
    world_size: int  # ranks the model is sharded over
    rank_tensor: torch.Tensor  # the rank as a 0-dim int64 tensor, so one traced graph serves every rank

    # Sum over ranks, in place.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    # [local_len, ...] -> [local_len * world_size, ...], rank order along dim 0.
    def all_gather_seq(self, x: torch.Tensor) -> torch.Tensor: ...

    # [num_tokens, ...] partial sums -> this rank's window [num_tokens / world_size, ...] of the sum.
    def reduce_scatter_seq(self, x: torch.Tensor) -> torch.Tensor: ...

    # [..., n] -> [..., n * world_size], rank order along the last dim.
    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class CheckpointPart:
    """One checkpoint tensor that makes up (part of) a model parameter on this rank."""

    name: str  # checkpoint tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # its full shape in the checkpoint
    shard_dim: int | None  # dim cut into world_size equal slices, rank r reads the r-th; None = whole


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raises ValueError naming the first size that does not split evenly over `world_size` ranks."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(
                f"{name} ({value}) must be divisible by the world size ({world_size}) to shard the model"
            )


def world_size_of(tp: ParallelGroup | None) -> int:
    return 1 if tp is None else tp.world_size


def window_rows(x: torch.Tensor, rank: torch.Tensor, world_size: int) -> torch.Tensor:
    """Rank `rank`'s sequence window of x: [num_tokens, ...] -> [num_tokens / world_size, ...].

    The rank is a 0-dim tensor, not a Python int, so one traced graph serves every rank (SPMD, as
    on Neuron) instead of baking one rank's offset in as a constant.
    """
    local_len = x.shape[0] // world_size
    return x.index_select(0, rank * local_len + torch.arange(local_len, device=x.device))


def local_rows(x: torch.Tensor | None, tp: ParallelGroup | None, sp: bool) -> torch.Tensor | None:
    """This rank's sequence window of a per-position tensor (`inputs_embeds`, `is_token_ids`)."""
    if x is None or tp is None or not sp:
        return x
    return window_rows(x, tp.rank_tensor, tp.world_size)


def gather_sequence(x: torch.Tensor, tp: ParallelGroup | None, sp: bool) -> torch.Tensor:
    """Input of a column-parallel block: [local_len, hidden] -> [num_tokens, hidden] under SP."""
    return tp.all_gather_seq(x) if tp is not None and sp else x


def row_parallel(
    projection: Projection,
    x: torch.Tensor,
    tp: ParallelGroup | None,
    sp: bool,
    delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A row-parallel projection, summed over ranks: to sequence slices under SP, replicated otherwise.

    x: [num_tokens, in_features / world_size] -> [local_len or num_tokens, out_features]. The bias is
    added once, after the sum. `delta(x, y) -> y` (a LoRA delta) adds to the projection's output
    before the sum: its A is sharded like the weight's inputs, so each rank's share sums too.
    """
    if tp is None:
        out = projection(x)
        return out if delta is None else delta(x, out)
    partial = projection(x, with_bias=False)  # [num_tokens, out_features], this rank's share of the sum
    if delta is not None:
        partial = delta(x, partial)
    out = tp.reduce_scatter_seq(partial) if sp else tp.all_reduce(partial)
    return out if projection.bias is None else out + projection.bias


def rows_for_logits(
    h: torch.Tensor, indices: torch.Tensor, tp: ParallelGroup | None, sp: bool
) -> torch.Tensor:
    """The rows whose logits are wanted. h: [local_len or num_tokens, hidden] -> [num_logits, hidden].

    Under SP each rank contributes the rows in its window and zeros for the rest; the all-reduce then
    moves num_logits rows instead of gathering the whole sequence, and sums exactly (x + 0 = x).
    """
    if tp is None or not sp:
        return h.index_select(0, indices)
    local_len = h.shape[0]
    local = indices - tp.rank_tensor * local_len  # [num_logits]; a rank tensor, as in window_rows
    is_mine = (local >= 0) & (local < local_len)
    rows = h.index_select(0, local.clamp(0, local_len - 1)).masked_fill(~is_mine[:, None], 0)
    return tp.all_reduce(rows)


def gather_vocab_logits(logits: torch.Tensor, tp: ParallelGroup | None) -> torch.Tensor:
    """This rank's logits [num_logits, vocab / world_size] -> float32 [num_logits, vocab] on every rank."""
    if tp is not None:
        logits = tp.all_gather_last(logits)
    return logits.float()


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding with this rank's rows of the vocabulary: [vocab / world_size, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelGroup | None) -> None:
        num_local = vocab_size // world_size_of(tp)
        super().__init__(num_local, hidden_size)
        self.tp = tp
        self.vocab_start = 0 if tp is None else tp.rank * num_local  # first vocabulary id held here

    def reset_parameters(self) -> None:
        # The loader builds the model on the meta device and assigns the checkpoint's table: there a
        # random init has no values to write, yet nn.Embedding's normal_ runs through torch._refs,
        # whose first call imports torch._dynamo (1.4-1.9 s of every decoder start on 2 cores).
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor, sp: bool = False) -> torch.Tensor:
        """input_ids: int [num_tokens] -> [local_len under SP, else num_tokens, hidden]."""
        if self.tp is None:
            return super().forward(input_ids)
        lookup = functools.partial(F.embedding, weight=self.weight)
        return vocab_parallel_rows(lookup, input_ids, self.vocab_start, self.num_embeddings, self.tp, sp)


def vocab_parallel_rows(
    lookup: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    vocab_start: int,
    num_local: int,
    tp: ParallelGroup,
    sp: bool,
) -> torch.Tensor:
    """The rows of input_ids (int [num_tokens]) from a table cut by vocabulary: this rank holds ids
    [vocab_start, vocab_start + num_local), which `lookup` (local ids [num_tokens] -> [num_tokens,
    hidden]) reads. Each rank gives zeros for the ids it lacks, so the sum over ranks is exact:
    [local_len under SP, else num_tokens, hidden]."""
    local_ids = input_ids - vocab_start  # [num_tokens]
    is_mine = (local_ids >= 0) & (local_ids < num_local)
    rows = lookup(local_ids.masked_fill(~is_mine, 0))  # [num_tokens, hidden]
    rows = rows.masked_fill(~is_mine[:, None], 0)
    return tp.reduce_scatter_seq(rows) if sp else tp.all_reduce(rows)


def checkpoint_parts(
    config: ModelConfig, name: str, local_shape: tuple[int, ...], world_size: int
) -> list[CheckpointPart]:
    """The checkpoint tensors behind parameter `name` (our naming, without "model."), and their shards.

    Fused parameters (qkv_proj, gate_up_proj) concatenate their parts' shards along dim 0 in the order
    listed, so a rank holds [q_r; k_r; v_r] and [gate_r; up_r].
    """
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    fused = {
        "qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
        "gate_up_proj": (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)),
    }
    hf_name = name if name.startswith("lm_head.") else f"model.{name}"
    module_path, _, leaf = hf_name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in fused:  # column-parallel: output rows split
        return [
            CheckpointPart(f"{parent}.{part}.{leaf}", (rows, *local_shape[1:]), 0)
            for part, rows in fused[module]
        ]
    if module in ("o_proj", "down_proj") and leaf == "weight":  # row-parallel: input columns split
        return [CheckpointPart(hf_name, (local_shape[0], local_shape[1] * world_size), 1)]
    if module in ("embed_tokens", "lm_head"):  # vocab-parallel
        return [CheckpointPart(hf_name, (local_shape[0] * world_size, *local_shape[1:]), 0)]
    return [CheckpointPart(hf_name, local_shape, None)]  # norms, row-parallel biases: replicated
