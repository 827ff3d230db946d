"""One step on the XLA device: host tensors in, the model traced lazily and run as one graph, logits out.

NOTE: what crosses. The weights and the paged KV cache live on the device for the engine's life; a
step sends only its int32 token IDs, positions, slot mapping, block tables and, in a prefill graph,
`is_token_ids` and the embedding rows of its embedding positions (zeros elsewhere, the static shape;
a decode graph's positions are all token IDs, so it takes neither) and, with LoRA on, each position's
adapter slot, and brings back the float32
logits of the rows it samples. The KV cache is written in place inside the graph: torch_xla
aliases an input buffer that the graph updates in place to its output (XLA's input/output aliasing),
so it never leaves the device.

NOTE: one graph per bucket. The model runs eagerly on lazy XLA tensors: every op is recorded, and
`torch_xla.sync()` hands the recorded graph to XLA, which compiles a graph the first time it sees it
and runs the cached executable every time after. A step's graph depends only on its bucket
(tokens x sequences x block-table width, decode or prefill), never on its values, because nothing
in the traced code reads a value back to the host: prefill attention takes its bounds from tensors
(attention.py), and the logits rows are a fixed `num_seqs` per bucket. Warmup runs every bucket
(engine/step/xla_runner.py), after which `num_compiles` must not move.

A step that scores prompt positions needs the final hidden row of every position: each graph also
outputs them (normed, [num_tokens, hidden]) and they stay on the device unless asked for; their
logits then come from one more graph, the LM head over `HEAD_ROWS` rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.decoder.backends.xla import runtime
from tandem.decoder.backends.xla.lora import XlaLoraTable
from tandem.decoder.backends.xla.sharding import ShardingPlan
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.lora import LoraStep, LoraTable
from tandem.decoder.models.transformer import DecoderModel

HEAD_ROWS = 32  # rows per call of the LM-head graph that scores prompt positions


@dataclass
class Transfers:
    """What one kind of graph moved between host and device, over the engine's life (torch_xla's
    InboundData / OutboundData metrics, read around each step)."""

    num_steps: int = 0
    bytes_to_device: int = 0
    bytes_from_device: int = 0

    def per_step(self) -> tuple[float, float]:
        """(bytes to the device, bytes from it) per step."""
        n = max(self.num_steps, 1)
        return self.bytes_to_device / n, self.bytes_from_device / n


class XlaStep:
    """The XLA backend's `ModelStep` (backends/backend.py): host tensors in, host tensors out."""

    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        sharding: ShardingPlan,
        lora: LoraTable | None = None,  # the host's LoRA slots, copied to the device; None: LoRA off
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # on the device, sharded with the model
        self.sharding = sharding
        self.device = model.device
        sharding.shard_model(model, kv_caches)
        # With LoRA on, every graph adds every row's delta (zeros for base rows: lora.py), so that
        # whether a step has adapted rows never makes another graph.
        self.lora = None if lora is None else XlaLoraTable(lora, self.device)
        self.decode = Transfers()  # decode graphs' traffic (the runner restarts the count after warmup)
        self.prefill = Transfers()  # prefill graphs' traffic (the logits' trip back included)

    def __call__(
        self,
        batch: ForwardBatch,  # host tensors; attn.logits_indices starts with one row per sequence
        kv_caches: list[torch.Tensor],  # the device caches this step was built with
    ) -> torch.Tensor:  # float32 [num_seqs, vocab_size], host
        before = runtime.transferred_bytes()
        logits, _ = self._run(batch, kv_caches)
        logits = logits.cpu()
        after = runtime.transferred_bytes()
        transfers = self.decode if batch.num_tokens == len(batch.attn.query_lens) else self.prefill
        transfers.num_steps += 1
        transfers.bytes_to_device += after[0] - before[0]
        transfers.bytes_from_device += after[1] - before[1]
        return logits

    def hidden_states(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:  # [len(attn.logits_indices), hidden_size], host: the final (normed) rows
        _, final = self._run(batch, kv_caches)
        return final.cpu().index_select(0, batch.attn.logits_indices)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size] on the host of final rows h [num_rows, hidden], host."""
        pieces = [torch.empty(0, self.model.config.vocab_size)]  # a step that samples no row
        for start in range(0, h.shape[0], HEAD_ROWS):
            rows = h[start : start + HEAD_ROWS]
            padded = torch.zeros(HEAD_ROWS, h.shape[1], dtype=self.model.config.dtype)
            padded[: rows.shape[0]] = rows
            logits = self.sharding.vocab_logits(self.model.compute_logits(padded.to(self.device)))
            runtime.sync()
            pieces.append(logits.cpu()[: rows.shape[0]])
        return torch.cat(pieces)

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def _run(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the step's graph: logits [num_seqs, vocab] and final rows [num_tokens, hidden], on device."""
        attn = batch.attn
        num_seqs = len(attn.query_lens)
        is_prefill = batch.num_tokens != num_seqs  # a decode graph has one position per sequence
        if is_prefill and (batch.inputs_embeds is None or batch.is_token_ids is None):
            raise ValueError("an XLA prefill step always takes inputs_embeds and is_token_ids (its shape)")
        device = self.device
        lora = None
        if self.lora is not None:
            slots = None if batch.lora is None else batch.lora.slots
            if slots is None:  # no row adapted: the same graph, every row the base model's
                slots = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
            lora = LoraStep(self.lora, slots.to(device))
        elif batch.lora is not None and batch.lora.slots is not None:
            raise ValueError("an XLA step built without LoRA slots takes no adapted rows")
        input_ids, positions = batch.input_ids.to(device), batch.positions.to(device)
        is_token_ids = None if batch.is_token_ids is None else batch.is_token_ids.to(device)
        inputs_embeds = None if batch.inputs_embeds is None else batch.inputs_embeds.to(device)
        assert attn.query_start_loc is not None
        meta = AttentionMetadata(
            query_lens=attn.query_lens,
            seq_lens=attn.seq_lens,
            seq_lens_t=attn.seq_lens_t.to(device),
            slot_mapping=attn.slot_mapping.to(device),
            block_tables=attn.block_tables.to(device),
            logits_indices=attn.logits_indices[:num_seqs].to(device),
            query_start_loc=attn.query_start_loc.to(device),
        )
        inputs = ForwardBatch(input_ids, positions, meta, inputs_embeds, is_token_ids, lora)
        self.sharding.step(inputs, is_prefill)
        model = self.model
        h = model.layer_states(inputs, kv_caches)  # [num_tokens, hidden]
        final = model.norm(h)  # [num_tokens, hidden]: every position, for a step that scores its prompt
        rows = self.sharding.whole(final.index_select(0, meta.logits_indices))  # [num_seqs, hidden]
        logits = self.sharding.vocab_logits(model.compute_logits(rows))  # [num_seqs, vocab]
        self.sharding.whole(final)
        runtime.sync()
        return logits, final
