"""The C kernels' limits, read from the build that was loaded, and the one question every caller asks of
them: does this shape fit (`fits`), and when it does not, which limit it passes.

csrc/limits.h holds the values and csrc/limits.c exports each as a symbol `tandem_<field>`, read by
name when a library loads (`Kernels.limits`): this side holds no copy of a number, so a header
changed and rebuilt is what the executor, the attention and the wrappers check against.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Limits:
    """One build's limits (csrc/limits.h); each field is the library's `tandem_<name>`."""

    max_head_dim: int  # dimensions of one attention head (attention and RoPE scratch)
    max_group: int  # query heads per KV head
    max_block_size: int  # positions per KV-cache block
    max_row: int  # longest row an RMSNorm takes (the hidden size)
    tiled_head_dim: int  # the tiled attention takes bf16 caches with head_dim a multiple of this
    prefill_max_context: int  # longest context a step with prefill attends through the row kernel

    @classmethod
    def read(cls, library: ctypes.CDLL) -> Limits:
        """The values `library` was built with; AttributeError naming the symbol it lacks."""
        return cls(**{f.name: ctypes.c_int64.in_dll(library, f"tandem_{f.name}").value for f in fields(cls)})


@dataclass(frozen=True)
class Fit:
    """fits()'s answer: true when the shape fits, else false with the first limit it passes."""

    reason: str = ""  # names the quantity and the limit's field, with both values; "" when it fits

    def __bool__(self) -> bool:
        return not self.reason


FITS = Fit()  # every shape that fits gets this one answer: the hot paths allocate nothing


def fits(
    limits: Limits,
    *,
    head_dim: int | None = None,  # dimensions of one head
    num_heads: int | None = None,  # query heads, with num_kv_heads: the group
    num_kv_heads: int | None = None,
    block_size: int | None = None,  # positions per KV-cache block
    row: int | None = None,  # the longest row a norm takes (the hidden size)
    rotary: bool = False,  # head_dim also even: RoPE rotates its halves (qkv_rope_cache)
    tiled: bool = False,  # for the tiled attention: head_dim a multiple of its tile, no prefill limit
    prefill_context: int | None = None,  # the longest context of a step with prefill (row kernel)
) -> Fit:
    """Whether the C kernels take these sizes; each one left None is not asked about."""
    if head_dim is not None:
        if not 1 <= head_dim <= limits.max_head_dim:
            return Fit(f"head_dim {head_dim} is outside [1, max_head_dim {limits.max_head_dim}]")
        if rotary and head_dim % 2:
            return Fit(f"head_dim {head_dim} must be even for RoPE")
        if tiled and head_dim % limits.tiled_head_dim:
            return Fit(f"head_dim {head_dim} is not a multiple of tiled_head_dim {limits.tiled_head_dim}")
    if num_heads is not None and num_kv_heads is not None:
        if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
            return Fit(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
        if num_heads // num_kv_heads > limits.max_group:
            return Fit(
                f"num_heads {num_heads} over num_kv_heads {num_kv_heads} is a group of "
                f"{num_heads // num_kv_heads}, past max_group {limits.max_group}"
            )
    if block_size is not None and not 1 <= block_size <= limits.max_block_size:
        return Fit(f"block_size {block_size} is outside [1, max_block_size {limits.max_block_size}]")
    if row is not None and not 1 <= row <= limits.max_row:
        return Fit(f"row {row} is outside [1, max_row {limits.max_row}]")
    if prefill_context is not None and not tiled and prefill_context > limits.prefill_max_context:
        return Fit(
            f"prefill_context {prefill_context} is past prefill_max_context {limits.prefill_max_context}"
        )
    return FITS
