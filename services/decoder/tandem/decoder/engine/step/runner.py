"""StepPlan -> StepBatch tensors -> model -> logits of the positions that sample.

Preparing a batch is three steps, one file each: packing the plan (`batch.py`, the dynamic shape),
padding to buckets in static-shape mode (`static_shapes.py`), padding for sequence parallelism with
several ranks (`sequence_parallel.py`). The runner owns the model and this rank's KV cache, picks
the step function, and with several ranks sends each batch to the others before running it.

Compiled static-shape mode (`compile_with` a backend) runs every decode-only bucket (num_tokens ==
num_seqs) as a graph compiled at warmup, one per bucket (`backends/torch_compile.py`); steps with
any prefill stay eager, because prefill attention loops over the host-side `query_lens` and
`seq_lens`, whose values a graph would have to specialise on. After `seal()` a decode signature
that warmup did not compile raises `RecompileError` rather than compiling in the middle of serving.

A step that scores prompt positions (`outputs/prompt_logprobs.py`) asks for their rows after the sampled
ones and reduces them here, before `execute` returns. It runs eagerly, since its logits count is
not the one a compiled bucket was built for. On one rank it stops before the LM head and takes the
scored rows' logits a slice at a time; with several ranks the head is a collective that the other
ranks run over every row at once, so rank 0 does the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.decoder.backends.backend import Backend, ModelStep, RecompileError, StepFn
from tandem.decoder.backends.torch_compile import TorchCompileBuckets
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprobsChunk, score
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan
from tandem.decoder.engine.step.batch import BatchTensors, HostBatch, StepBatch, pack, rows_apart
from tandem.decoder.engine.step.sequence_parallel import pad_for_sequence_parallel
from tandem.decoder.engine.step.static_shapes import (
    StaticShapes,
    pad_to_buckets,
    padded_width,
    padding_batch,
    warmup_shapes,
)
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.peft_adapter import LoraAdapter
from tandem.decoder.models.tensor_parallel import world_size_of
from tandem.decoder.models.transformer import DecoderModel


@dataclass(frozen=True)
class Signature:
    """What a compiled or traced graph depends on: padded sizes and the attention path."""

    num_tokens: int
    num_seqs: int
    block_table_width: int
    is_decode_only: bool


@dataclass(frozen=True)
class StepOutput:
    """What one step's forward pass returns to the engine."""

    logits: torch.Tensor  # float32 [num_sampling_seqs, vocab] of the requests with needs_logits, in order
    prompt_logprobs: tuple[PromptLogprobsChunk, ...] = ()  # the prompt positions scored this step


class StepFeed(Protocol):
    """Where rank 0 sends each batch before running it (the other ranks run the same one)."""

    def send(self, batch: StepBatch) -> None: ...

    # Between steps: every rank writes its shard of `adapter` into LoRA slot `slot`.
    def install_adapter(self, slot: int, adapter: LoraAdapter) -> None: ...

    def keepalive(self) -> None: ...

    # The last word (STOP; ABORT: rank 0 failed, the other ranks stop non-zero): TimeoutError when some rank
    # has not taken it within a bound (step_broadcast.END_WAIT_S), the word left queued.
    def stop(self) -> None: ...

    def abort(self) -> None: ...


class ModelRunner:
    """Owns the model and its KV cache (this rank's shard of both); turns plans into logits."""

    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        static: StaticShapes | None = None,
        peers: StepFeed | None = None,
        compile_with: Backend | None = None,  # static mode: compile each decode bucket; None = eager
        batch_invariant: bool = False,  # one forward pass per request (see execute)
        executor: ModelStep | None = None,  # what runs eager steps (the CPU executor); None = the model
        lora: LoraTable | None = None,  # LoRA slots (the executor's, when it has one); None = off
    ) -> None:
        self.model = model
        self.executor: ModelStep = executor or model
        self.block_size = block_size
        self.static = static
        self.peers = peers  # rank 0 of several: the other ranks' feed; None otherwise
        self.world_size = world_size_of(model.tp)
        self.device = model.device
        # lora: every batch carries its rows' adapters on this table (the executor's, when it has one).
        self.tensors = BatchTensors(self.device, model.config.hidden_size, model.config.dtype, lora)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.signatures: set[Signature] = set()  # distinct input signatures seen so far
        self.compiler = None
        if compile_with is not None:
            if static is None:
                raise ValueError("compiled decode buckets need static shapes")
            self.compiler = TorchCompileBuckets(compile_with, model, self.kv_caches, len(static.seq_buckets))
        self.compiled_steps: dict[Signature, StepFn] = {}  # decode buckets compiled so far
        self.batch_invariant = batch_invariant

    def slots_written(self) -> None:
        """The LoRA table changed (an adapter was written into a slot). The host's slots are what this
        runner's steps read: nothing to do here; a runner with a device copy uploads it again."""

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Logits for the plan's requests with needs_logits, and the prompt positions scored this step.

        Batch-invariant: each request runs a forward pass of its own, with the shapes it would have
        alone. Matrix kernels pick their blocking by the number of rows (MKL's float32 GEMM gives a
        row other bits at 1 row than among 8; oneDNN's bf16 does the same), so no other guarantee
        holds on every CPU and library; this one holds by construction. A verification's rows are one
        request's, yet several: unless the step's linears keep a row's order at any row count (the
        executor's `rows_exact`), they run one at a time too, as the plain decode steps would.
        """
        splits = not getattr(self.executor, "rows_exact", False)
        if self.batch_invariant and (
            len(plan.scheduled) > 1 or (splits and any(i.num_draft_tokens for i in plan.scheduled))
        ):
            outputs = [out for item in plan.scheduled for out in self._execute_alone(plan, item, splits)]
            return StepOutput(
                logits=torch.cat([o.logits for o in outputs]),
                prompt_logprobs=tuple(chunk for o in outputs for chunk in o.prompt_logprobs),
            )
        return self._execute(plan)

    def _execute_alone(self, plan: StepPlan, item: ScheduledRequest, splits: bool) -> list[StepOutput]:
        """Batch-invariant: one request's step; a verification's rows one at a time when `splits`."""
        alone = _alone(plan, item)
        if not (splits and item.num_draft_tokens):
            return [self._execute(alone)]
        rows = rows_apart(pack(alone, self.block_size))
        return [StepOutput(self.forward(self._tensors(row))[:1]) for row in rows]

    def _execute(self, plan: StepPlan) -> StepOutput:
        batch = self.prepare(plan)
        if not batch.scored_spans:
            return StepOutput(self.forward(batch)[: batch.num_logits])
        if self.world_size == 1:
            return self._execute_scoring(batch)
        # Several ranks: the head is a collective every rank runs on the same rows, and the others
        # run `forward`, so rank 0 takes every row's logits at once: [num_rows, vocab] for this step.
        logits = self.forward(batch)  # [num_logits_rows + num_scored_rows, vocab]
        scored = logits[logits.shape[0] - batch.num_scored_rows :]  # [num_scored_rows, vocab]
        chunks = score(lambda rows: scored[rows], batch.scored_spans, logits.device)
        return StepOutput(logits[: batch.num_logits], tuple(chunks))

    def _execute_scoring(self, batch: StepBatch) -> StepOutput:
        """One rank: the hidden rows of the whole step, then the head over a slice of the scored rows
        at a time, so the step holds [SLICE_ROWS, vocab] logits rather than one row per position."""
        self._announce(batch)
        h = self.executor.hidden_states(batch.inputs, self.kv_caches)  # [rows, hidden]
        scored = h[h.shape[0] - batch.num_scored_rows :]  # [num_scored_rows, hidden]
        logits_of = self.executor.compute_logits
        chunks = score(lambda rows: logits_of(scored[rows]), batch.scored_spans, h.device)
        return StepOutput(logits_of(h[: batch.num_logits]), tuple(chunks))

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits float32 [num_logits_rows, vocab] at the batch's logits_indices (every rank calls it)."""
        signature = self._announce(batch)
        # Every rank tells a step that scores prompt positions from its batch alone, by its logits count.
        is_scoring = batch.inputs.attn.logits_indices.shape[0] != signature.num_seqs
        step = self.executor if is_scoring else self._step_for(signature)
        return step(batch.inputs, self.kv_caches)

    def _announce(self, batch: StepBatch) -> Signature:
        """Record the batch's signature and, on rank 0 of several, send the batch to the other ranks."""
        attn = batch.inputs.attn
        signature = Signature(
            num_tokens=batch.inputs.num_tokens,
            num_seqs=len(attn.query_lens),
            block_table_width=attn.block_tables.shape[1],
            is_decode_only=attn.is_decode_only,
        )
        self.signatures.add(signature)
        if self.peers is not None:
            self.peers.send(batch)
        return signature

    def summary(self) -> str | None:
        """What the runner has to say about its life when the engine stops (None: nothing)."""
        return None

    def seal(self) -> None:
        """Warmup is over: from now on a decode bucket that would compile raises RecompileError."""
        if self.compiler is not None:
            self.compiler.seal()

    def _step_for(self, signature: Signature) -> StepFn:
        if self.compiler is None or not signature.is_decode_only:
            return self.executor
        step = self.compiled_steps.get(signature)
        if step is None:
            if self.compiler.is_sealed:
                raise RecompileError(f"decode bucket {signature} was not compiled at warmup")
            step = self.compiled_steps[signature] = self.compiler.bucket()
        return step

    def prepare(self, plan: StepPlan) -> StepBatch:
        return self._tensors(pack(plan, self.block_size))

    def _tensors(self, host: HostBatch) -> StepBatch:
        if self.static is None:
            width = max(len(t) for t in host.block_tables)
            batch = self.tensors.batch(host, width, has_embeds=bool(host.embed_pieces))
        else:
            pad_to_buckets(host, self.static, self.block_size)
            width = padded_width(self.static, host, self.block_size)
            batch = self.tensors.batch(host, width, has_embeds=True)
        return batch if self.world_size == 1 else pad_for_sequence_parallel(batch, self.world_size)

    def warm_up(self) -> None:
        """Static mode: every bucket (tokens, seqs, table width) runs once on dummy inputs; then sealed."""
        assert self.static is not None
        for num_tokens, num_seqs, block_table_width in warmup_shapes(self.static):
            self.warmup(num_tokens, num_seqs, block_table_width)
        self.seal()

    @torch.inference_mode()
    def warmup(self, num_tokens: int, num_seqs: int, block_table_width: int | None = None) -> None:
        """Run one all-padding batch of exactly these bucket sizes (writes only the null block).

        block_table_width None: the widest bucket.
        """
        assert self.static is not None
        host = padding_batch(num_tokens, num_seqs, self.block_size)
        width = block_table_width or self.static.block_table_widths[-1]
        batch = self.tensors.batch(host, width, has_embeds=True)
        self.forward(pad_for_sequence_parallel(batch, self.world_size))


def _alone(plan: StepPlan, item: ScheduledRequest) -> StepPlan:
    """The plan of one of `plan`'s requests, as if it were the only one."""
    return StepPlan(
        scheduled=(item,),
        num_batched_tokens=item.num_new_tokens,
        preempted_ids=(),
        num_free_blocks_after=plan.num_free_blocks_after,
    )
