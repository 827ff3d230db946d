"""Sequence-parallel preparation: a step with any prefill padded to a multiple of the world size.

With several ranks, a step with any prefill runs sequence-parallel: each rank holds one window of
its positions, so the token count is padded with tokens past every sequence (they write the null
block and their attention rows are zeros). Decode-only steps run tensor-parallel only, unpadded.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.decoder.engine.scheduling.kv_cache import NULL_BLOCK_ID
from tandem.decoder.engine.step.batch import StepBatch


def pad_for_sequence_parallel(batch: StepBatch, world_size: int) -> StepBatch:
    """Pads a step with any prefill to a multiple of `world_size` tokens; decode-only steps as they are.

    Padding tokens sit past every sequence: token 0 at position 0, KV slot 0 (the null block).
    """
    inputs = batch.inputs
    num_pad = -inputs.num_tokens % world_size
    if inputs.attn.is_decode_only or num_pad == 0:
        return batch

    def pad(x: torch.Tensor, value: float | bool) -> torch.Tensor:  # [num_tokens, ...] -> [+ num_pad, ...]
        return torch.cat((x, x.new_full((num_pad, *x.shape[1:]), value)))

    lora = inputs.lora
    if lora is not None and lora.slots is not None:
        lora = dataclasses.replace(lora, slots=pad(lora.slots, -1))
    padded = dataclasses.replace(
        inputs,
        input_ids=pad(inputs.input_ids, 0),
        positions=pad(inputs.positions, 0),
        is_token_ids=None if inputs.is_token_ids is None else pad(inputs.is_token_ids, True),
        inputs_embeds=None if inputs.inputs_embeds is None else pad(inputs.inputs_embeds, 0),
        attn=dataclasses.replace(inputs.attn, slot_mapping=pad(inputs.attn.slot_mapping, NULL_BLOCK_ID)),
        lora=lora,
    )
    return dataclasses.replace(batch, inputs=padded)
