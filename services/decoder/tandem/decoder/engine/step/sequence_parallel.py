"""Sequence-parallel preparation: a step with any prefill padded to a multiple of the world size.

With several ranks, a step with any prefill runs sequence-parallel: each rank holds one window of
its positions, so the token count is padded with tokens past every sequence (they write the null
block and their attention rows are zeros). Decode-only steps run tensor-parallel only, unpadded.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.decoder.engine.scheduling.kv_cache import NULL_BLOCK_ID
from tandem.decoder.engine.step.batch import ForwardBatch


def pad_for_sequence_parallel(batch: ForwardBatch, world_size: int) -> ForwardBatch:
    """Pads a step with any prefill to a multiple of `world_size` tokens; decode-only steps as they are.

    Padding tokens sit past every sequence: token 0 at position 0, KV slot 0 (the null block).
    """
    num_tokens = batch.input_ids.shape[0]
    num_pad = -num_tokens % world_size
    if batch.attn.is_decode_only or num_pad == 0:
        return batch

    def pad(x: torch.Tensor, value: float | bool) -> torch.Tensor:  # [num_tokens, ...] -> [+ num_pad, ...]
        return torch.cat((x, x.new_full((num_pad, *x.shape[1:]), value)))

    return dataclasses.replace(
        batch,
        input_ids=pad(batch.input_ids, 0),
        positions=pad(batch.positions, 0),
        is_token_ids=None if batch.is_token_ids is None else pad(batch.is_token_ids, True),
        inputs_embeds=None if batch.inputs_embeds is None else pad(batch.inputs_embeds, 0),
        attn=dataclasses.replace(batch.attn, slot_mapping=pad(batch.attn.slot_mapping, NULL_BLOCK_ID)),
        lora_slots=None if batch.lora_slots is None else pad(batch.lora_slots, -1),
    )
