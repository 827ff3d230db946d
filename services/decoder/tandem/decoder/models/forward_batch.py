"""One forward pass's inputs: what crosses from whoever packs a step to whatever runs it.

NOTE: what belongs here. Only what changes every step and is read by the forward itself: the packed
positions, where they sit in the paged cache, the prompt-embedding rows, each row's adapter. State
that lives as long as the runner (the KV cache, the kernels a backend bound) stays a separate
argument of the step function, and what only the engine reads about a step (how many logits rows
sample, which prompt positions are scored) stays in the engine's own step object around this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.lora import LoraStep


@dataclass(frozen=True)
class ForwardBatch:
    """One forward pass's inputs, packed along the token dimension."""

    input_ids: torch.Tensor  # int32 [num_tokens]; 0 at embedding and padding positions
    positions: torch.Tensor  # int64 (or int32) [num_tokens]
    attn: AttentionMetadata
    # [num_tokens, hidden_size] in the model dtype, zeros at token positions; None when every position
    # is a token ID (a token-only dynamic step, an XLA decode graph).
    inputs_embeds: torch.Tensor | None = None
    is_token_ids: torch.Tensor | None = None  # bool [num_tokens], True = token ID; None: all are
    # Each row's adapter (models/lora.py: the runner's table and the rows' slots); None: LoRA off.
    lora: LoraStep | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
