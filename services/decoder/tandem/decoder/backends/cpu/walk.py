"""A one-rank step's layers on the CPU: the one-call decode stack, a mixed step in parts, or the model's loop.

Bound into the model's forward as its walk kernel (models/kernels.py) by the executor (executor.py)
when it has a decode stack (stack.py) or a plan that gives prompt chunks kernels of their own
(prefill_split.py: why a split stays exact). Everything else is the model's own loop, called with
the layers' kernels this chooses: the bound ones, or the prompt chunks' own for a prefill part.
"""

from __future__ import annotations

import torch

from tandem.decoder.backends.cpu import prefill_split
from tandem.decoder.backends.cpu.stack import DecodeStack
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.kernels import LayerKernels, LayerLoop
from tandem.decoder.models.lora import LoraStep


class CpuWalk:
    """models/kernels.py's WalkKernel: decode-only steps on the stack, mixed steps split where planned."""

    def __init__(
        self,
        stack: DecodeStack | None,  # every layer of a decode-only step in one C call; None: the loop
        split_rows: int,  # prompt chunks of this many rows or more run as a part of their own; 0: never
        prefill_layers: tuple[LayerKernels, ...] = (),  # that part's layers' kernels; (): the step's own
    ) -> None:
        self.stack = stack
        self.split_rows = split_rows
        self.prefill_layers = prefill_layers

    def __call__(
        self,
        loop: LayerLoop,
        h: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer
        lora: LoraStep | None,
        layers: tuple[LayerKernels, ...],
    ) -> torch.Tensor:
        parts = prefill_split.split_step(attn, h.shape[0], self.split_rows) if self.split_rows else None
        if parts is None:
            return self._whole(loop, h, cos, sin, attn, kv_caches, lora, layers)

        def run_part(
            h: torch.Tensor,  # [num_rows, hidden_size]
            cos: torch.Tensor,  # [num_rows, 1, head_dim]
            sin: torch.Tensor,  # [num_rows, 1, head_dim]
            attn: AttentionMetadata,
            kv_caches: list[torch.Tensor],
            is_prefill: bool,
            lora: LoraStep | None,  # this part's rows' adapters
        ) -> torch.Tensor:
            if is_prefill and self.prefill_layers:
                return loop(h, cos, sin, attn, kv_caches, lora, self.prefill_layers)
            return self._whole(loop, h, cos, sin, attn, kv_caches, lora, layers)

        return prefill_split.run_parts(parts, h, cos, sin, kv_caches, run_part, lora)

    def _whole(
        self,
        loop: LayerLoop,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: LoraStep | None,
        layers: tuple[LayerKernels, ...],
    ) -> torch.Tensor:
        """Steps (or parts) that run whole: every layer in one C call when decode-only, else the loop."""
        if self.stack is not None and attn.is_decode_only:
            slots = None if lora is None else lora.slots  # int64 [num_rows]; None: no row is adapted
            return self.stack.run(h, cos, sin, attn, kv_caches, slots)
        return loop(h, cos, sin, attn, kv_caches, lora, layers)
