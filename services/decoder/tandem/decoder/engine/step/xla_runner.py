"""The XLA backend's model runner: every step split into static-shape graphs, compiled at warmup only.
The device side (the step, the attention, the sharding) is backends/xla/.

NOTE: how a step becomes graphs. The scheduler's plan mixes decodes, speculative verification rows
and prefill chunks as on any backend. Here it runs as one decode graph for every row that has one
query (decodes and verified proposals, padded to a decode bucket of rows), then one prefill graph
per prompt chunk (padded to a bucket of positions past the sequence's end), and the sampled rows are
put back in the plan's order. A prefill graph holds one sequence, so its attention (attention.py)
costs its positions times its own context, never the batch's.

Batches are built on the host (int32 IDs, positions, slots, block tables, the embedding rows of
embedding positions) and the step (step.py) sends them to the device. After `seal()` (warmup done)
a bucket that was not warmed up raises RecompileError before anything is traced, and the runtime's
own compile counter must not move: `num_compiles_after_warmup` says whether it did.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from tandem.decoder.backends.backend import RecompileError
from tandem.decoder.backends.xla import runtime
from tandem.decoder.backends.xla.sharding import ShardingPlan
from tandem.decoder.backends.xla.step import Transfers, XlaStep
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan
from tandem.decoder.engine.step.batch import BatchTensors, HostBatch, StepBatch, pack
from tandem.decoder.engine.step.runner import ModelRunner, Signature, StepOutput
from tandem.decoder.engine.step.static_shapes import append_padding
from tandem.decoder.engine.step.xla_buckets import Bucket, XlaBuckets
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.transformer import DecoderModel

log = logging.getLogger(__name__)

HOST = torch.device("cpu")


class XlaRunner(ModelRunner):
    """A ModelRunner whose model and KV cache live on an XLA device and whose steps are bucketed graphs."""

    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        buckets: XlaBuckets,
        sharding: ShardingPlan,
        batch_invariant: bool = False,
        lora: LoraTable | None = None,  # the LoRA slots, on the host (the step keeps a device copy)
    ) -> None:
        super().__init__(model, num_blocks, block_size, batch_invariant=batch_invariant)
        runtime.wait()  # the weights' transfers done: only data that is there can be resharded
        self.buckets = buckets
        self.executor = self.step = XlaStep(model, self.kv_caches, sharding, lora)
        # The zeroed KV caches are still a lazy graph here: marked first, they are materialized as
        # their shards. Materialized before, every device held the pool whole until it was resharded
        # (host_pool.py: a 1 GiB pool split over 2 devices peaked at 3.72 GB RSS, 1.9 GB now).
        runtime.sync()
        # Batches, sampling and prompt scoring happen on the host; only the step crosses to the device.
        self.device = HOST
        self.tensors = BatchTensors(HOST, model.config.hidden_size, model.config.dtype, lora)
        self.warmed: set[Bucket] = set()
        self.is_sealed = False
        self.num_compiles_at_seal = 0
        self._num_compiles_reported = 0  # after warmup, up to the last warning
        self.compile_s = 0.0  # seconds of warmup spent compiling and running every bucket once

    @torch.no_grad()  # not inference_mode: torch_xla's lazy tensors need version counters
    def execute(self, plan: StepPlan) -> StepOutput:
        parts = _alone_each(plan) if self.batch_invariant else _graph_parts(plan)
        outputs = [self._execute(part) for part in parts]
        if self.is_sealed and self.num_compiles_after_warmup > self._num_compiles_reported:
            self._num_compiles_reported = self.num_compiles_after_warmup
            log.warning("XLA compiled a graph after warmup (%d so far)", self._num_compiles_reported)
        return outputs[0] if len(parts) == 1 else _in_plan_order(plan, parts, outputs)

    def prepare(self, plan: StepPlan) -> StepBatch:
        host = pack(plan, self.block_size)
        max_seq_len = max(host.seq_lens)
        if all(_has_one_query_per_row(item) for item in plan.scheduled):
            bucket = self.buckets.decode(len(host.query_lens), max_seq_len)
            num_real = len(host.query_lens)
            # A row that samples nothing (a one-position prompt chunk) still has a logits row: every
            # sequence's, real ones first (`num_logits` of them sample), so the count is the bucket's.
            host.logits_rows += [host.logits_rows[-1] if host.logits_rows else 0] * (
                num_real - len(host.logits_rows)
            )
            append_padding(host, [1] * (bucket.num_seqs - num_real), self.block_size)
            # Decode positions are token IDs: the merge is a pass-through, so no embedding rows cross.
            return self.tensors.batch(host, bucket.width, has_embeds=False)
        bucket = self.buckets.prefill(len(host.input_ids), max_seq_len)
        _pad_positions(host, bucket.num_tokens)
        return self.tensors.batch(host, bucket.width, has_embeds=True)

    def slots_written(self) -> None:
        """The host's LoRA slots changed (an adapter was written into one): upload them again."""
        if self.step.lora is not None:
            self.step.lora.refresh()

    def _announce(self, batch: StepBatch) -> Signature:
        """Every step passes here before its graph is traced (plain and prompt-scoring steps alike)."""
        bucket = _bucket_of(batch)
        if self.is_sealed and bucket not in self.warmed:
            raise RecompileError(f"{bucket} was not compiled at warmup")
        return super()._announce(batch)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Every bucket once on all-padding inputs (writes only the null block), the LM-head graph once;
        then sealed."""
        start = time.perf_counter()
        for bucket in self.buckets.all():
            host = HostBatch()
            if bucket.is_decode:
                append_padding(host, [1] * bucket.num_seqs, self.block_size)
            else:
                append_padding(
                    host, [min(bucket.num_tokens, bucket.width * self.block_size)], self.block_size
                )
                _pad_positions(host, bucket.num_tokens)
            batch = self.tensors.batch(host, bucket.width, has_embeds=not bucket.is_decode)
            self.step(batch.inputs, self.kv_caches)
            self.warmed.add(_bucket_of(batch))
        self.step.compute_logits(torch.zeros(1, self.model.config.hidden_size, dtype=self.model.config.dtype))
        self.compile_s = time.perf_counter() - start
        self.seal()
        log.info(
            "XLA warmup: %d graphs compiled (%d buckets and the LM head) in %.1f s",
            self.num_compiles_at_seal,
            len(self.warmed),
            self.compile_s,
        )

    def seal(self) -> None:
        self.is_sealed = True
        self.num_compiles_at_seal = runtime.num_compiles()
        self.step.decode, self.step.prefill = Transfers(), Transfers()  # count serving, not warmup

    def summary(self) -> str:
        decode_in, decode_out = self.step.decode.per_step()
        return (
            f"XLA: {self.num_compiles_after_warmup} graphs compiled after warmup; "
            f"{self.step.decode.num_steps} decode steps, {decode_in:.0f} bytes to the device and "
            f"{decode_out:.0f} back per step; {self.step.prefill.num_steps} prefill steps"
        )

    @property
    def num_compiles_after_warmup(self) -> int:
        return runtime.num_compiles() - self.num_compiles_at_seal if self.is_sealed else 0


def _bucket_of(batch: StepBatch) -> Bucket:
    num_tokens, (num_seqs, width) = batch.inputs.num_tokens, batch.inputs.attn.block_tables.shape
    return Bucket(num_tokens, num_seqs, width, is_decode=num_tokens == num_seqs)


def _pad_positions(host: HostBatch, num_tokens: int) -> None:
    """Pads a prefill chunk with positions past its sequence (token 0 at position 0, writing the null
    block's slot 0); they attend to nothing and their rows are zeros. One logits row: the sequence's
    sampled row, or row 0 when the chunk samples nothing."""
    pad = num_tokens - len(host.input_ids)
    host.input_ids.extend([0] * pad)
    host.positions.extend([0] * pad)
    host.slots.extend([0] * pad)
    host.is_token_ids.extend([True] * pad)
    host.lora_slots.extend([-1] * pad)
    if not host.logits_rows:
        host.logits_rows.append(0)


def _graph_parts(plan: StepPlan) -> list[StepPlan]:
    """The plan as graphs: one for every single-query row (decodes and verifications), then one per
    prefill chunk (and per recompute of several outputs)."""
    rows = [item for item in plan.scheduled if _has_one_query_per_row(item)]
    chunks = [item for item in plan.scheduled if not _has_one_query_per_row(item)]
    parts = [_sub_plan(plan, rows)] if rows else []
    return parts + [_sub_plan(plan, [item]) for item in chunks]


def _alone_each(plan: StepPlan) -> list[StepPlan]:
    return [_sub_plan(plan, [item]) for item in plan.scheduled]


def _has_one_query_per_row(item: ScheduledRequest) -> bool:
    """A decode or a verification (its proposals each a row), never a prompt position: those may be
    embedding rows and run in prefill graphs, even one at a time."""
    return not item.is_prefill and (item.num_draft_tokens > 0 or item.num_new_tokens == 1)


def _sub_plan(plan: StepPlan, items: list[ScheduledRequest]) -> StepPlan:
    return dataclasses.replace(
        plan,
        scheduled=tuple(items),
        num_batched_tokens=sum(i.num_new_tokens for i in items),
        preempted_ids=(),
    )


def _in_plan_order(plan: StepPlan, parts: list[StepPlan], outputs: list[StepOutput]) -> StepOutput:
    """The parts' sampled rows back in the plan's order (1 + proposals rows per sampling request)."""
    rows_of: dict[str, torch.Tensor] = {}
    for part, output in zip(parts, outputs, strict=True):
        row = 0
        for item in part.scheduled:
            if item.needs_logits:
                n = 1 + item.num_draft_tokens
                rows_of[item.request_id] = output.logits[row : row + n]
                row += n
    ordered = [rows_of[item.request_id] for item in plan.scheduled if item.needs_logits]
    logits = torch.cat(ordered) if ordered else outputs[0].logits[:0]
    return StepOutput(logits, tuple(chunk for output in outputs for chunk in output.prompt_logprobs))
