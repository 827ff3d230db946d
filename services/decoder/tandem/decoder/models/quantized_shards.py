"""A rank's share of a quantized weight under tensor parallelism, cut as the dense weights are
(models/tensor_parallel.py): column-parallel qkv_proj / gate_up_proj and the vocab-parallel token
table and LM head by output rows, row-parallel o_proj / down_proj by input columns.

NOTE: the cut is made on the one-rank model's quantized weight, never by rounding a rank's dense
shard, so each rank holds the codes, scales and offsets the one-rank model holds for its part, value
for value. Rounding a shard would not give them: int8's scale is one per output channel, the largest
|w| of a whole row, which a rank holding half the row's inputs cannot see, and an int4 group of more
than 32 inputs may straddle two ranks. A GGUF tensor is read whole for the same reason (and to put
llama.cpp's RoPE row order back, which spans a projection's heads).
- Row-parallel: the rank's inputs are whole blocks of 32 (each block carries its own scale and
  offset, its group's), so its slice of every row is the one-rank row's blocks, and the rank's share
  of the layer's input (o_proj's heads, down_proj's intermediate slice) starts on a block too, which
  `--quantized-activations int8` rounds per block of 32 as one rank does. `check_cuttable` refuses
  other shapes before any weight is read.
- Column-parallel: rows are cut out and packed again (`pack` pads the last group of 16 outputs with
  zeros), so a cut need not fall on a group of the storage layout: every row is rounded alone, with
  every input of its own.
"""

from __future__ import annotations

from tandem.common.torch_part.quantized_tensor import BLOCK, QuantizedTensor, pack
from tandem.decoder.models.config import ModelConfig


def row_parallel_widths(config: ModelConfig) -> dict[str, int]:
    """The input width of each projection cut by its inputs, by what the width is."""
    return {
        "o_proj (num_heads * head_dim)": config.num_heads * config.head_dim,
        "down_proj (intermediate_size)": config.intermediate_size,
    }


def check_cuttable(config: ModelConfig, world_size: int) -> None:
    """Raises ValueError naming the projection and the limit unless every row-parallel projection's
    inputs split into `world_size` equal shares of whole blocks of 32."""
    for what, width in row_parallel_widths(config).items():
        if width % (world_size * BLOCK) != 0:
            raise ValueError(
                f"{what} takes {width} inputs, {width / world_size:g} per rank over {world_size} ranks: "
                f"quantized weights are cut on whole blocks of {BLOCK} inputs, so each rank's share must "
                f"be a multiple of {BLOCK}"
            )


def cut(weight: QuantizedTensor, shard_dim: int | None, rank: int, world_size: int) -> QuantizedTensor:
    """Rank `rank`'s share of `weight` [n, k]: the rank-th of `world_size` equal slices of its output
    rows (shard_dim 0) or its inputs (shard_dim 1, on whole blocks); the whole weight for None.
    Raises ValueError for a dimension that does not split so."""
    if shard_dim is None or world_size == 1:
        return weight
    length = weight.shape[shard_dim]
    size = length // world_size
    if length % world_size != 0 or (shard_dim == 1 and size % BLOCK != 0):
        unit = f"whole blocks of {BLOCK}" if shard_dim == 1 else "equal slices"
        raise ValueError(
            f"a quantized weight of {list(weight.shape)} cannot be cut along dim {shard_dim} "
            f"into {world_size} {unit}"
        )
    codes, d, m = weight.unpack()  # codes [n, k], d and m [n, k / 32]
    if shard_dim == 0:
        rows = slice(rank * size, (rank + 1) * size)
        return pack(codes[rows], d[rows], None if m is None else m[rows])
    inputs = slice(rank * size, (rank + 1) * size)
    blocks = slice(rank * size // BLOCK, (rank + 1) * size // BLOCK)
    return pack(
        codes[:, inputs].contiguous(),
        d[:, blocks].contiguous(),
        None if m is None else m[:, blocks].contiguous(),
    )
