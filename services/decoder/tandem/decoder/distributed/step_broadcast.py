"""Rank 0 -> other ranks: each step's batch (StepBatch) as a fixed header and packed payloads, no pickles.

NOTE: the message. Every message starts with an int32 header of HEADER_LEN fields (`kind` first).
A STEP is followed by one int32 payload holding, in order: input_ids [T], positions [T],
slot_mapping [T], query_lens [S], seq_lens [S], block_tables [S * W], logits_indices [L], the
batch offsets of embedding positions [E] and, when a row of the step uses a LoRA adapter, each
row's slot [T] (-1: the base model); then, if E > 0, the embedding rows [E, hidden] as raw tensor
bytes in the model dtype. Workers rebuild exactly the batch rank 0 runs (the flags are True
everywhere but at the E offsets, the other rows of inputs_embeds are zeros), so every rank executes
the same forward. An ADAPTER message (between steps, before any step names its slot) carries a
loaded adapter whole: an int32 payload of (layer, module) pairs in TARGETS' numbering [2P], then
one float32 payload of its scale and every pair's A [rank, in] and B [out, rank] in that order;
each worker writes its own shard into the slot (models/lora.py). KEEPALIVE messages flow while
rank 0 is idle, so a worker's receive never waits longer than the group timeout unless rank 0 is
gone; STOP ends the worker loop. ABORT ends it as rank 0's failure (its set-up after the KV pool's
agreement, its warmup, a step's fault): the worker exits non-zero at once (rank_zero_failed.py). Rank 0
waits END_WAIT_S at most for STOP or ABORT to be taken: a worker still inside a step's forward (it
waits in the model's collectives, not here) takes it once that ends, or fails at the group timeout.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from tandem.decoder.engine.step.batch import StepBatch
from tandem.decoder.engine.step.rank_zero_failed import RankZeroFailed
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.lora import LoraStep, LoraTable
from tandem.decoder.models.peft_adapter import TARGETS, LoraAdapter
from tandem.decoder.models.peft_weights import module_shapes


class ControlChannel(Protocol):
    """The control group's one operation; `parallel.ControlGroup` is the real one, tests replay a list."""

    # Rank 0 sends `x`; the others receive into it (same shape and dtype) and get it back. `within_s`:
    # rank 0 raises TimeoutError if some rank has not taken it in that long (the send stays queued).
    def broadcast(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor: ...


class Kind(enum.IntEnum):
    STEP = 1
    KEEPALIVE = 2
    STOP = 3
    ADAPTER = 4
    ABORT = 5


# STEP: kind, num_tokens, num_seqs, table_width, num_logits_indices, num_embed_rows, has_inputs_embeds,
# num_logits, has_lora_slots. ADAPTER: kind, slot, rank, num_pairs.
HEADER_LEN = 9
# How long rank 0 waits for its last word (STOP, ABORT) to be taken: a worker in its step loop takes it at
# once; one that is not there (hung in a step, or gone) must not hold rank 0's shutdown for the group
# timeout (a STOP to a hung rank held a drain ~2 timeouts). The word stays queued: a worker arriving
# later while rank 0 lives still takes it; otherwise it stops at its own collective's timeout.
END_WAIT_S = 1.0


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
        lora_slots = None if batch.lora is None else batch.lora.slots  # int64 [T], or None: no adapter
        self._header(
            Kind.STEP,
            num_tokens,
            num_seqs,
            width,
            attn.logits_indices.shape[0],
            embed_offsets.shape[0],
            int(batch.inputs_embeds is not None),
            step.num_logits,
            int(lora_slots is not None),
        )
        parts = [
            batch.input_ids.int(),
            batch.positions.int(),
            attn.slot_mapping.int(),
            torch.tensor(attn.query_lens, dtype=torch.int32, device=batch.input_ids.device),
            attn.seq_lens_t.int(),
            attn.block_tables.int().flatten(),
            attn.logits_indices.int(),
            embed_offsets.int(),
        ]
        if lora_slots is not None:
            parts.append(lora_slots.int())
        payload = torch.cat(parts).cpu()  # int32 [3T + 2S + S*W + L + E (+ T)]
        self.control.broadcast(payload)
        if embed_offsets.shape[0]:
            assert batch.inputs_embeds is not None
            self.control.broadcast(batch.inputs_embeds.index_select(0, embed_offsets).cpu().contiguous())

    def install_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Every worker writes its shard of `adapter` into `slot` (between steps, as rank 0 does)."""
        pairs = sorted(adapter.weights, key=lambda pair: (pair[0], TARGETS.index(pair[1])))
        self._header(Kind.ADAPTER, slot, adapter.rank, len(pairs))
        keys = [value for layer, module in pairs for value in (layer, TARGETS.index(module))]
        self.control.broadcast(torch.tensor(keys, dtype=torch.int32))  # [2P]
        values = [torch.tensor([adapter.scale], dtype=torch.float32)]
        for pair in pairs:
            a, b = adapter.weights[pair]
            values += [a.float().flatten(), b.float().flatten()]
        self.control.broadcast(torch.cat(values))  # float32 [1 + sum of A's and B's sizes]

    def keepalive(self) -> None:
        self._header(Kind.KEEPALIVE)

    def stop(self) -> None:
        """Raises TimeoutError when some worker has not taken it within END_WAIT_S."""
        self.control.broadcast(_header(Kind.STOP), within_s=END_WAIT_S)

    def abort(self) -> None:
        """Raises TimeoutError when some worker has not taken it within END_WAIT_S."""
        self.control.broadcast(_header(Kind.ABORT), within_s=END_WAIT_S)

    def _header(self, kind: Kind, *fields: int) -> None:
        self.control.broadcast(_header(kind, *fields))


def _header(kind: Kind, *fields: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int32)
    header[0] = kind
    header[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.int32)
    return header


def receive_step(
    control: ControlChannel,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    lora: LoraTable | None = None,  # this rank's LoRA slots (its shard); None: LoRA is off
) -> StepBatch | None:
    """A worker's side: the next step's batch, or None when rank 0 says STOP (keepalives skipped,
    adapters written into `lora` as they come). Raises RankZeroFailed when rank 0 says ABORT."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int32)
    while True:
        kind, *fields = control.broadcast(header).tolist()
        if kind == Kind.STOP:
            return None
        if kind == Kind.ABORT:
            raise RankZeroFailed("rank 0 failed")
        if kind == Kind.ADAPTER:
            _receive_adapter(control, lora, *fields[:3])
        if kind == Kind.STEP:
            break
    num_tokens, num_seqs, width, num_indices, num_embeds, has_embeds, num_logits, has_lora_slots = fields
    t, s = num_tokens, num_seqs
    num_slots = t if has_lora_slots else 0
    payload = torch.empty(3 * t + 2 * s + s * width + num_indices + num_embeds + num_slots, dtype=torch.int32)
    control.broadcast(payload)
    input_ids, positions, slots, query_lens, seq_lens, tables, logits_indices, offsets, lora_slots = (
        payload.split([t, t, t, s, s, s * width, num_indices, num_embeds, num_slots])
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
        # As rank 0's: a step on the table whenever LoRA is on, its slots only when a row is adapted.
        lora=None if lora is None else LoraStep(lora, lora_slots.long() if has_lora_slots else None),
    )
    return StepBatch(inputs, num_logits=num_logits)


def _receive_adapter(
    control: ControlChannel, lora: LoraTable | None, slot: int, rank: int, num_pairs: int
) -> None:
    """Receives an ADAPTER message's payloads and writes this rank's shard of it into `slot`."""
    keys = control.broadcast(torch.empty(2 * num_pairs, dtype=torch.int32)).view(num_pairs, 2).tolist()
    if lora is None:
        raise RuntimeError("rank 0 sent a LoRA adapter to a rank whose LoRA is off")
    shapes = module_shapes(lora.config)
    pairs = [(layer, TARGETS[module]) for layer, module in keys]
    sizes = [n for _, module in pairs for n in (rank * shapes[module][1], shapes[module][0] * rank)]
    values = control.broadcast(torch.empty(1 + sum(sizes), dtype=torch.float32))
    scale, *tensors = values.split([1, *sizes])
    weights = {}
    for i, (layer, module) in enumerate(pairs):
        out_features, in_features = shapes[module]
        a, b = tensors[2 * i].view(rank, in_features), tensors[2 * i + 1].view(out_features, rank)
        weights[(layer, module)] = (a, b)
    targets = tuple(t for t in TARGETS if any(module == t for _, module in pairs))
    lora.write(slot, LoraAdapter(rank=rank, scale=scale.item(), targets=targets, weights=weights))
