"""Rank 0 -> other ranks: each step's batch (StepBatch) as a fixed header and packed payloads, no pickles.

NOTE: the message. Every message starts with an int32 header of HEADER_LEN fields (`kind` first).
A STEP is followed by one int32 payload holding, in order: input_ids [T], positions [T],
slot_mapping [T], query_lens [S], seq_lens [S], block_tables [S * W], logits_indices [L] and the
batch offsets of embedding positions [E]; then, if E > 0, the embedding rows [E, hidden] as raw
tensor bytes in the model dtype. Workers rebuild exactly the batch rank 0 runs (the flags are True
everywhere but at the E offsets, the other rows of inputs_embeds are zeros), so every rank executes
the same forward. KEEPALIVE messages flow while rank 0 is idle, so a worker's receive never waits
longer than the group timeout unless rank 0 is gone; STOP ends the worker loop.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from tandem.decoder.engine.step.batch import StepBatch
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.forward_batch import ForwardBatch


class ControlChannel(Protocol):
    """The control group's one operation; `parallel.ControlGroup` is the real one, tests replay a list."""

    # Rank 0 sends `x`; the others receive into it (same shape and dtype) and get it back.
    def broadcast(self, x: torch.Tensor) -> torch.Tensor: ...


class Kind(enum.IntEnum):
    STEP = 1
    KEEPALIVE = 2
    STOP = 3


# kind, num_tokens, num_seqs, table_width, num_logits_indices, num_embed_rows, has_inputs_embeds,
# num_logits
HEADER_LEN = 8


class StepSender:
    """Rank 0's side. Called from the engine thread only, in step order."""

    def __init__(self, control: ControlChannel) -> None:
        self.control = control

    def send(self, step: StepBatch) -> None:
        batch = step.inputs
        attn = batch.attn
        num_tokens = batch.num_tokens
        num_seqs, width = attn.block_tables.shape
        is_embedding = torch.zeros(num_tokens, dtype=torch.bool, device=batch.input_ids.device)
        if batch.is_token_ids is not None:
            is_embedding = ~batch.is_token_ids
        embed_offsets = is_embedding.nonzero().flatten()  # [E]
        self._header(
            Kind.STEP,
            num_tokens,
            num_seqs,
            width,
            attn.logits_indices.shape[0],
            embed_offsets.shape[0],
            int(batch.inputs_embeds is not None),
            step.num_logits,
        )
        payload = torch.cat(
            [
                batch.input_ids.int(),
                batch.positions.int(),
                attn.slot_mapping.int(),
                torch.tensor(attn.query_lens, dtype=torch.int32, device=batch.input_ids.device),
                attn.seq_lens_t.int(),
                attn.block_tables.int().flatten(),
                attn.logits_indices.int(),
                embed_offsets.int(),
            ]
        ).cpu()  # int32 [3T + 2S + S*W + L + E]
        self.control.broadcast(payload)
        if embed_offsets.shape[0]:
            assert batch.inputs_embeds is not None
            self.control.broadcast(batch.inputs_embeds.index_select(0, embed_offsets).cpu().contiguous())

    def keepalive(self) -> None:
        self._header(Kind.KEEPALIVE)

    def stop(self) -> None:
        self._header(Kind.STOP)

    def _header(self, kind: Kind, *fields: int) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int32)
        header[0] = kind
        header[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.int32)
        self.control.broadcast(header)


def receive_step(
    control: ControlChannel, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> StepBatch | None:
    """A worker's side: the next step's batch, or None when rank 0 says STOP (keepalives skipped)."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int32)
    while True:
        kind, num_tokens, num_seqs, width, num_indices, num_embeds, has_embeds, num_logits = (
            control.broadcast(header).tolist()
        )
        if kind == Kind.STOP:
            return None
        if kind == Kind.STEP:
            break
    t, s = num_tokens, num_seqs
    payload = torch.empty(3 * t + 2 * s + s * width + num_indices + num_embeds, dtype=torch.int32)
    control.broadcast(payload)
    input_ids, positions, slots, query_lens, seq_lens, tables, logits_indices, offsets = payload.split(
        [t, t, t, s, s, s * width, num_indices, num_embeds]
    )
    inputs_embeds = is_token_ids = None
    if has_embeds:
        inputs_embeds = torch.zeros(t, hidden_size, dtype=dtype)  # [T, hidden]
        is_token_ids = torch.ones(t, dtype=torch.bool)  # [T]
        if num_embeds:
            rows = control.broadcast(torch.empty(num_embeds, hidden_size, dtype=dtype))  # [E, hidden]
            inputs_embeds[offsets.long()] = rows
            is_token_ids[offsets.long()] = False
    attn = AttentionMetadata(
        query_lens=query_lens.tolist(),
        seq_lens=seq_lens.tolist(),
        seq_lens_t=seq_lens.to(device),
        slot_mapping=slots.to(device, torch.int64),
        block_tables=tables.view(s, width).to(device),
        logits_indices=logits_indices.to(device, torch.int64),
    )
    inputs = ForwardBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device, torch.int64),
        attn=attn,
        inputs_embeds=None if inputs_embeds is None else inputs_embeds.to(device),
        is_token_ids=None if is_token_ids is None else is_token_ids.to(device),
    )
    return StepBatch(inputs, num_logits=num_logits)
