"""StepPlan -> ForwardBatch tensors -> model -> logits of the positions that sample.

NOTE: the activation check. `inputs_embeds` and `is_token_ids` are built only when a scheduled
position still comes from an embedding row: token-only steps (every decode step, most prefills)
carry int32 IDs and nothing else, and the model embeds them on its device. Embedding rows stay in
their request until the step that schedules them, then are copied once into the batch buffer.

Static-shape mode pads the token count and the sequence count to buckets and always passes both
`inputs_embeds` (zeros) and `is_token_ids` (all True where not an embedding), so every step has
one of a known set of input signatures; warmup runs each once and `signatures` records them.
Padding tokens write their KV into the reserved null block 0 and attend to it alone.

Compiled static-shape mode (`compile_with` a backend) runs every decode-only bucket (num_tokens ==
num_seqs) as a graph compiled at warmup, one per bucket (`backends/buckets.py`); steps with
any prefill stay eager, because prefill attention loops over the host-side `query_lens` and
`seq_lens`, whose values a graph would have to specialise on. After `seal()` a decode signature
that warmup did not compile raises `RecompileError` rather than compiling in the middle of serving.

With several ranks, a step with any prefill runs sequence-parallel: its token count is padded to a
multiple of the world size with tokens past every sequence (they write the null block and their
attention rows are zeros), and rank 0 sends each batch to the other ranks before running it.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol

import torch

from services.decoder.backends.backend import Backend, RecompileError, StepFn
from services.decoder.backends.buckets import bucket_compiler
from services.decoder.engine.kv_cache import NULL_BLOCK_ID
from services.decoder.engine.scheduler import StepPlan
from services.decoder.models.attention import AttentionMetadata
from services.decoder.models.tensor_parallel import world_size_of
from services.decoder.models.transformer import DecoderModel


@dataclass(frozen=True)
class ForwardBatch:
    """One forward pass's inputs, packed along the token dimension."""

    input_ids: torch.Tensor  # int32 [num_tokens]; 0 at embedding and padding positions
    positions: torch.Tensor  # int64 [num_tokens]
    is_token_ids: torch.Tensor | None  # bool [num_tokens]; None on token-only dynamic steps
    inputs_embeds: torch.Tensor | None  # [num_tokens, hidden_size]; None on token-only dynamic steps
    attn: AttentionMetadata
    num_logits: int  # leading rows of the returned logits that belong to real sequences


@dataclass(frozen=True)
class Signature:
    """What a compiled or traced graph depends on: padded sizes and the attention path."""

    num_tokens: int
    num_seqs: int
    block_table_width: int
    is_decode_only: bool


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= limit (so sequence buckets are token buckets)."""
    buckets = [1]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    index = bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


@dataclass(frozen=True)
class StaticShapes:
    """Buckets for static-shape mode; every padded size is one of these."""

    token_buckets: tuple[int, ...]  # padded num_tokens
    seq_buckets: tuple[int, ...]  # padded num_seqs
    block_table_width: int  # fixed: blocks of the longest allowed sequence


class StepSink(Protocol):
    """Where rank 0 sends each batch before running it (the other ranks run the same one)."""

    def send(self, batch: ForwardBatch) -> None: ...

    def keepalive(self) -> None: ...

    def stop(self) -> None: ...


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
    )


class ModelRunner:
    """Owns the model and its KV cache (this rank's shard of both); turns plans into logits."""

    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        static: StaticShapes | None = None,
        sink: StepSink | None = None,
        compile_with: Backend | None = None,  # static mode: compile each decode bucket; None = eager
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.static = static
        self.sink = sink  # rank 0 of several: the other ranks' feed; None otherwise
        self.world_size = world_size_of(model.tp)
        self.device = model.embed_tokens.weight.device
        self.hidden_size = model.config.hidden_size
        self.dtype = model.config.dtype
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.signatures: set[Signature] = set()  # distinct input signatures seen so far
        self.compiler = None
        if compile_with is not None:
            if static is None:
                raise ValueError("compiled decode buckets need static shapes")
            self.compiler = bucket_compiler(compile_with, model, self.kv_caches, len(static.seq_buckets))
        self.compiled_steps: dict[Signature, StepFn] = {}  # decode buckets compiled so far

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits float32 [num_sampling_seqs, vocab] for the plan's requests with needs_logits, in order."""
        batch = self.prepare(plan)
        logits = self.forward(batch)
        return logits[: batch.num_logits]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        attn = batch.attn
        signature = Signature(
            num_tokens=batch.input_ids.shape[0],
            num_seqs=len(attn.query_lens),
            block_table_width=attn.block_tables.shape[1],
            is_decode_only=attn.is_decode_only,
        )
        self.signatures.add(signature)
        if self.sink is not None:
            self.sink.send(batch)
        step = self._step_for(signature)
        return step(
            batch.input_ids, batch.positions, attn, self.kv_caches, batch.inputs_embeds, batch.is_token_ids
        )

    def seal(self) -> None:
        """Warmup is over: from now on a decode bucket that would compile raises RecompileError."""
        if self.compiler is not None:
            self.compiler.seal()

    def _step_for(self, signature: Signature) -> StepFn:
        if self.compiler is None or not signature.is_decode_only:
            return self.model
        step = self.compiled_steps.get(signature)
        if step is None:
            if self.compiler.is_sealed:
                raise RecompileError(f"decode bucket {signature} was not compiled at warmup")
            step = self.compiled_steps[signature] = self.compiler.bucket()
        return step

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        is_token: list[bool] = []
        embed_pieces: list[tuple[int, torch.Tensor]] = []  # (batch offset, rows [n, hidden])
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[tuple[int, ...]] = []
        logits_rows: list[int] = []  # packed index of each sampling sequence's last position
        for item in plan.scheduled:
            req, start, end = item.request, item.start, item.end
            offset = len(input_ids)
            num_prompt = req.num_prompt_tokens
            if start >= num_prompt:  # decode (or recompute of outputs): all token positions
                input_ids.extend(req.output_token_ids[start - num_prompt : end - num_prompt])
                is_token.extend([True] * (end - start))
            else:
                prompt_end = min(end, num_prompt)
                input_ids.extend(req.prompt_token_ids[start:prompt_end])
                is_token.extend(req.is_token_ids[start:prompt_end])
                input_ids.extend(req.output_token_ids[: max(0, end - num_prompt)])
                is_token.extend([True] * max(0, end - num_prompt))
                for span in req.embedding_spans:
                    lo, hi = max(span.start, start), min(span.end, prompt_end)
                    if lo < hi:
                        rows = span.rows[lo - span.start : hi - span.start]  # [hi - lo, hidden]
                        embed_pieces.append((offset + lo - start, rows))
            positions.extend(range(start, end))
            block_ids = item.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(block_ids)
            if item.needs_logits:
                logits_rows.append(len(input_ids) - 1)
        num_logits = len(logits_rows)
        if self.static is not None:
            batch = self._pad_static(
                input_ids, positions, slots, is_token, embed_pieces, query_lens, seq_lens, tables, logits_rows
            )
            return batch if self.world_size == 1 else pad_for_sequence_parallel(batch, self.world_size)
        width = max(len(t) for t in tables)
        batch = ForwardBatch(
            input_ids=self._tensor(input_ids, torch.int32),
            positions=self._tensor(positions, torch.int64),
            is_token_ids=self._tensor(is_token, torch.bool) if embed_pieces else None,
            inputs_embeds=self._embeds(len(input_ids), embed_pieces) if embed_pieces else None,
            attn=self._metadata(query_lens, seq_lens, slots, tables, width, logits_rows),
            num_logits=num_logits,
        )
        return batch if self.world_size == 1 else pad_for_sequence_parallel(batch, self.world_size)

    def _pad_static(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        is_token: list[bool],
        embed_pieces: list[tuple[int, torch.Tensor]],
        query_lens: list[int],
        seq_lens: list[int],
        tables: list[tuple[int, ...]],
        logits_rows: list[int],
    ) -> ForwardBatch:
        assert self.static is not None
        num_logits = len(logits_rows)
        num_real_seqs, num_real_tokens = len(query_lens), len(input_ids)
        num_seqs, num_tokens = self._padded_sizes(num_real_seqs, num_real_tokens)
        pad_seqs = num_seqs - num_real_seqs
        # Each padding sequence holds one query; the last one also absorbs the remaining padding
        # tokens, so a batch is decode-only exactly when num_tokens == num_seqs.
        pad_query_lens = [1] * pad_seqs
        if pad_seqs:
            pad_query_lens[-1] += num_tokens - num_real_tokens - pad_seqs
        for n in pad_query_lens:
            logits_rows.append(len(input_ids) + n - 1)
            input_ids.extend([0] * n)
            positions.extend(range(n))
            # A padding sequence writes and reads only the null block, however long it is.
            slots.extend(p % self.block_size for p in range(n))
            is_token.extend([True] * n)
            query_lens.append(n)
            seq_lens.append(n)
            tables.append((NULL_BLOCK_ID,))
        # The logits count is part of the signature: always num_seqs rows, sampling rows first.
        logits_rows += [logits_rows[-1]] * (num_seqs - len(logits_rows))
        return ForwardBatch(
            input_ids=self._tensor(input_ids, torch.int32),
            positions=self._tensor(positions, torch.int64),
            is_token_ids=self._tensor(is_token, torch.bool),
            inputs_embeds=self._embeds(num_tokens, embed_pieces),
            attn=self._metadata(
                query_lens, seq_lens, slots, tables, self.static.block_table_width, logits_rows[:num_seqs]
            ),
            num_logits=num_logits,
        )

    def _padded_sizes(self, num_real_seqs: int, num_real_tokens: int) -> tuple[int, int]:
        """Bucketed (num_seqs, num_tokens); tokens padded only where a padding sequence can hold them."""
        assert self.static is not None
        num_seqs = _bucket(self.static.seq_buckets, num_real_seqs)
        num_tokens = _bucket(self.static.token_buckets, num_real_tokens + num_seqs - num_real_seqs)
        if num_tokens > num_real_tokens and num_seqs == num_real_seqs:
            num_seqs = _bucket(self.static.seq_buckets, num_real_seqs + 1)
            num_tokens = _bucket(self.static.token_buckets, num_real_tokens + num_seqs - num_real_seqs)
        return num_seqs, num_tokens

    @torch.inference_mode()
    def warmup(self, num_tokens: int, num_seqs: int) -> None:
        """Run one all-padding batch of exactly these bucket sizes (writes only the null block)."""
        assert self.static is not None
        pad_query_lens = [1] * num_seqs
        pad_query_lens[-1] += num_tokens - num_seqs
        input_ids: list[int] = []
        logits_rows: list[int] = []
        for n in pad_query_lens:
            input_ids.extend([0] * n)
            logits_rows.append(len(input_ids) - 1)
        batch = ForwardBatch(
            input_ids=self._tensor(input_ids, torch.int32),
            positions=self._tensor([p for n in pad_query_lens for p in range(n)], torch.int64),
            is_token_ids=self._tensor([True] * num_tokens, torch.bool),
            inputs_embeds=self._embeds(num_tokens, []),
            attn=self._metadata(
                pad_query_lens,
                list(pad_query_lens),
                [p % self.block_size for n in pad_query_lens for p in range(n)],
                [(NULL_BLOCK_ID,)] * num_seqs,
                self.static.block_table_width,
                logits_rows,
            ),
            num_logits=0,
        )
        self.forward(pad_for_sequence_parallel(batch, self.world_size))

    def _metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        slots: list[int],
        tables: list[tuple[int, ...]],
        width: int,
        logits_rows: list[int],
    ) -> AttentionMetadata:
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        padded = [list(t[:width]) + [NULL_BLOCK_ID] * (width - len(t)) for t in tables]
        return AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            cu_query_lens=self._tensor(cu, torch.int32),
            seq_lens_t=self._tensor(seq_lens, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(padded, torch.int32),
            logits_indices=self._tensor(logits_rows, torch.int64),
        )

    def _embeds(self, num_tokens: int, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        embeds = torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        for offset, rows in pieces:
            embeds[offset : offset + rows.shape[0]] = rows  # casts to the model dtype
        return embeds

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
