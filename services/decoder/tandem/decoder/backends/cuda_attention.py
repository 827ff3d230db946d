"""The CUDA backend's attention: FlexPagedAttention with FlexAttention compiled to Triton kernels."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import flex_attention

from tandem.decoder.models.flex_attention import FlexPagedAttention


class CudaPagedAttention(FlexPagedAttention):
    """Eager steps call FlexAttention compiled on its own; a compiled decode bucket lowers it in place.

    dynamic=True: eager steps vary in sequences, rows and block-table width, and a graph per size
    would soon pass dynamo's recompile limit, after which FlexAttention falls back to its unfused
    path (scores over the whole KV pool). Compiled decode buckets are static and keep the
    split-KV decoding kernel open (it needs a static batch).
    """

    def __init__(self) -> None:
        super().__init__(torch.compile(flex_attention, dynamic=True, fullgraph=True))
