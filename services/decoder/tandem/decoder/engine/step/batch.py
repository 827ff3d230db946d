"""Dynamic preparation: one StepPlan packed along the token dimension into a StepBatch.

NOTE: the activation check. `inputs_embeds` and `is_token_ids` are built only when a scheduled
position still comes from an embedding row: token-only steps (every decode step, most prefills)
carry int32 IDs and nothing else, and the model embeds them on its device. Embedding rows stay in
their request until the step that schedules them, then are copied once into the batch buffer.

Packing happens in two stages: `pack` gathers a plan into host lists (`HostBatch`), which
static-shape padding (`static_shapes.py`) may still extend, and `BatchTensors` turns the lists into
tensors on the model's device in one go.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tandem.decoder.engine.outputs.prompt_logprobs import ScoredSpan, positions_to_score, scored_span
from tandem.decoder.engine.scheduling.kv_cache import NULL_BLOCK_ID
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.lora import LoraStep, LoraTable


@dataclass(frozen=True)
class StepBatch:
    """One step as the runner runs it: the forward's inputs, and what only the engine reads of it."""

    inputs: ForwardBatch  # what the model, the executor and the other ranks take
    num_logits: int  # leading rows of the returned logits that belong to real sequences
    # Prompt positions scored this step, in order: their rows are the last num_scored_rows entries of
    # inputs.attn.logits_indices.
    scored_spans: tuple[ScoredSpan, ...] = ()

    @property
    def num_scored_rows(self) -> int:
        return sum(span.num_rows for span in self.scored_spans)


@dataclass
class HostBatch:
    """A step's inputs as host lists, before they become tensors. Static padding appends to them."""

    input_ids: list[int] = field(default_factory=list)  # [num_tokens]; 0 at embedding positions
    positions: list[int] = field(default_factory=list)  # [num_tokens]
    slots: list[int] = field(default_factory=list)  # [num_tokens] KV slot each position writes
    is_token_ids: list[bool] = field(default_factory=list)  # [num_tokens]
    # (batch offset, rows [n, hidden_size]) of each run of embedding positions
    embed_pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # [num_tokens] LoRA slot, -1 = base model
    query_lens: list[int] = field(default_factory=list)  # [num_seqs] positions scheduled per sequence
    seq_lens: list[int] = field(default_factory=list)  # [num_seqs] context length after this step
    block_tables: list[tuple[int, ...]] = field(default_factory=list)  # [num_seqs] block ids
    logits_rows: list[int] = field(default_factory=list)  # packed index of each sampled last position
    num_logits: int = 0  # leading logits_rows that belong to real sequences (the rest is padding)
    # Packed index of each position whose logits score the next prompt position (outputs/prompt_logprobs.py),
    # returned after every logits_rows entry, padding included; one span per request that scores.
    scored_rows: list[int] = field(default_factory=list)
    scored_spans: list[ScoredSpan] = field(default_factory=list)


def pack(plan: StepPlan, block_size: int) -> HostBatch:
    """The plan's scheduled positions, request after request, as host lists."""
    host = HostBatch()
    for item in plan.scheduled:
        if item.num_draft_tokens:
            _pack_verification(host, item, block_size)
            continue
        req, start, end = item.request, item.start, item.end
        offset = len(host.input_ids)
        num_prompt = req.num_prompt_tokens
        if start >= num_prompt:  # decode (or recompute of outputs): all token positions
            host.input_ids.extend(req.output_token_ids[start - num_prompt : end - num_prompt])
            host.is_token_ids.extend([True] * (end - start))
        else:
            prompt_end = min(end, num_prompt)
            host.input_ids.extend(req.prompt_token_ids[start:prompt_end])
            host.is_token_ids.extend(req.is_token_ids[start:prompt_end])
            host.input_ids.extend(req.output_token_ids[: max(0, end - num_prompt)])
            host.is_token_ids.extend([True] * max(0, end - num_prompt))
            for span in req.embedding_spans:
                lo, hi = max(span.start, start), min(span.end, prompt_end)
                if lo < hi:
                    rows = span.rows[lo - span.start : hi - span.start]  # [hi - lo, hidden]
                    host.embed_pieces.append((offset + lo - start, rows))
        host.positions.extend(range(start, end))
        host.lora_slots.extend([req.adapter_slot] * (end - start))
        block_ids = item.block_ids
        host.slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        host.query_lens.append(end - start)
        host.seq_lens.append(end)
        host.block_tables.append(block_ids)
        if item.needs_logits:
            host.logits_rows.append(len(host.input_ids) - 1)
        _add_scored_rows(host, item, offset)
    host.num_logits = len(host.logits_rows)
    return host


def _pack_verification(host: HostBatch, item: ScheduledRequest, block_size: int) -> None:
    """A decode step that verifies proposed tokens: the last sampled token, then the proposal.

    Each position attends as a sequence of its own (query length 1, context up to and including
    itself, the request's block table), which is exactly causal attention over the request: so a
    step of decodes and verifications is still decode-only, one batched attention call per layer
    (the C kernel on CPU). Every position is sampled.
    """
    req, start = item.request, item.start
    ids = [req.output_token_ids[-1], *req.draft_token_ids[: item.num_draft_tokens]]  # [1 + n]
    for j, token_id in enumerate(ids):
        position = start + j
        host.logits_rows.append(len(host.input_ids))
        host.input_ids.append(token_id)
        host.is_token_ids.append(True)
        host.positions.append(position)
        host.lora_slots.append(req.adapter_slot)  # verified rows run the request's own adapter
        host.slots.append(item.block_ids[position // block_size] * block_size + position % block_size)
        host.query_lens.append(1)
        host.seq_lens.append(position + 1)
        host.block_tables.append(item.block_ids)


def rows_apart(host: HostBatch) -> list[HostBatch]:
    """A verification's packed rows (`_pack_verification`: each a sequence of query length 1, sampled,
    no embedding or scored rows) as one-row batches, in order. Run one after another, row j's step
    writes the KV row j + 1 reads, so each row gets the bits of a plain decode step at any linear's
    blocking: what --batch-invariant promises where the linears order a row's sums by the row count."""
    return [
        HostBatch(
            input_ids=[host.input_ids[i]],
            positions=[host.positions[i]],
            slots=[host.slots[i]],
            is_token_ids=[host.is_token_ids[i]],
            lora_slots=[host.lora_slots[i]],
            query_lens=[1],
            seq_lens=[host.seq_lens[i]],
            block_tables=[host.block_tables[i]],
            logits_rows=[0],
            num_logits=1,
        )
        for i in range(len(host.input_ids))
    ]


def _add_scored_rows(host: HostBatch, item: ScheduledRequest, offset: int) -> None:
    """The rows scoring prompt positions of a request that asked for prompt logprobs; none otherwise."""
    positions = positions_to_score(item)
    if positions:
        host.scored_rows.extend(offset + p - item.start for p in positions)
        host.scored_spans.append(scored_span(item, positions))


class BatchTensors:
    """Turns host lists into tensors on the model's device."""

    def __init__(
        self,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,
        lora: LoraTable | None = None,  # the runner's LoRA slots; None: LoRA off (no batch carries any)
    ) -> None:
        self.device = device
        self.hidden_size = hidden_size
        self.dtype = dtype  # of the inputs_embeds buffer: the model's
        self.lora = lora

    def batch(self, host: HostBatch, block_table_width: int, has_embeds: bool) -> StepBatch:
        """`has_embeds` False: no `inputs_embeds` / `is_token_ids` at all (a token-only dynamic step)."""
        inputs = ForwardBatch(
            input_ids=self.tensor(host.input_ids, torch.int32),
            positions=self.tensor(host.positions, torch.int64),
            attn=self.metadata(host, block_table_width),
            inputs_embeds=self.embeds(len(host.input_ids), host.embed_pieces) if has_embeds else None,
            is_token_ids=self.tensor(host.is_token_ids, torch.bool) if has_embeds else None,
            lora=self.lora_step(host.lora_slots),
        )
        return StepBatch(inputs, num_logits=host.num_logits, scored_spans=tuple(host.scored_spans))

    def lora_step(self, slots: list[int]) -> LoraStep | None:
        """The rows' adapters: no slots tensor when no row uses one (its rows run the plain calls)."""
        if self.lora is None:
            return None
        adapted = max(slots, default=-1) >= 0
        return LoraStep(self.lora, self.tensor(slots, torch.int64) if adapted else None)

    def metadata(self, host: HostBatch, width: int) -> AttentionMetadata:
        padded = [list(t[:width]) + [NULL_BLOCK_ID] * (width - len(t)) for t in host.block_tables]
        return AttentionMetadata(
            query_lens=host.query_lens,
            seq_lens=host.seq_lens,
            seq_lens_t=self.tensor(host.seq_lens, torch.int32),
            slot_mapping=self.tensor(host.slots, torch.int64),
            block_tables=self.tensor(padded, torch.int32),
            logits_indices=self.tensor(host.logits_rows + host.scored_rows, torch.int64),
            query_start_loc=self.tensor(list(itertools.accumulate(host.query_lens, initial=0)), torch.int32),
        )

    def embeds(self, num_tokens: int, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        embeds = torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        for offset, rows in pieces:
            embeds[offset : offset + rows.shape[0]] = rows  # a copy: build_request cast the rows already
        return embeds

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
