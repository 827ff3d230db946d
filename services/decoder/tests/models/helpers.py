"""Test helpers: a toy paged KV allocator that builds AttentionMetadata, and Hugging Face references.

The allocator hands out blocks sequentially from 1 (block 0 is the engine's null block) and never
frees them; with a small block size, sequences span several non-adjacent blocks.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.transformer import DecoderModel


class PagedAllocator:
    """Gives each sequence blocks in allocation order and describes steps as AttentionMetadata."""

    def __init__(self, num_blocks: int = 128, block_size: int = 4) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.next_block = 1
        self.blocks: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}

    def metadata(self, chunks: Sequence[tuple[Hashable, int]], all_logits: bool = False) -> AttentionMetadata:
        """Allocates blocks for `chunks` (sequence key, number of new tokens) and describes the step.

        Logits are asked for at each chunk's last token, or at every token with `all_logits`.
        """
        query_lens, seq_lens, slots, block_lists = [], [], [], []
        for key, num_new in chunks:
            start = self.seq_lens.get(key, 0)
            end = start + num_new
            blocks = self.blocks.setdefault(key, [])
            while len(blocks) * self.block_size < end:
                assert self.next_block < self.num_blocks, "toy KV pool exhausted"
                blocks.append(self.next_block)
                self.next_block += 1
            slots += [
                blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            self.seq_lens[key] = end
            query_lens.append(num_new)
            seq_lens.append(end)
            block_lists.append(blocks)
        width = max(len(b) for b in block_lists)
        block_tables = torch.tensor([b + [0] * (width - len(b)) for b in block_lists], dtype=torch.int32)
        last_rows = torch.tensor(query_lens).cumsum(0) - 1  # packed index of each sequence's last token
        num_tokens = sum(query_lens)
        return AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            logits_indices=torch.arange(num_tokens) if all_logits else last_rows,
        )


class PagedRun:
    """Runs a model step by step over its own paged KV cache, packing the given chunks in order.

    `step` runs the forward: the model itself by default, or an executor bound to it.
    """

    def __init__(
        self, model: DecoderModel, num_blocks: int = 128, block_size: int = 4, step: Any = None
    ) -> None:
        self.model = model if step is None else step
        self.allocator = PagedAllocator(num_blocks, block_size)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)

    def step(
        self,
        chunks: Sequence[tuple[Hashable, Sequence[int]]],
        all_logits: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        is_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward over `chunks` (sequence key, new token ids) packed in order.

        Returns the logits of each chunk's last token, or of every token with `all_logits`.
        """
        starts = [self.allocator.seq_lens.get(key, 0) for key, _ in chunks]
        positions = [
            p for start, (_, ids) in zip(starts, chunks, strict=True) for p in range(start, start + len(ids))
        ]
        attn = self.allocator.metadata([(key, len(ids)) for key, ids in chunks], all_logits)
        input_ids = torch.tensor([t for _, ids in chunks for t in ids], dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int32)
        batch = ForwardBatch(input_ids, positions_t, attn, inputs_embeds, is_token_ids)
        return self.model(batch, self.kv_caches)


def greedy(
    model: DecoderModel, prompt: Sequence[int], max_new_tokens: int, block_size: int = 4, step: Any = None
) -> list[int]:
    """Prefill then one decode step per token, through the paged cache (`step`: an executor bound to
    the model runs the forward instead of the model itself)."""
    run = PagedRun(model, block_size=block_size, step=step)
    logits = run.step([("s", prompt)])
    tokens = [int(logits[0].argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(int(run.step([("s", tokens[-1:])])[0].argmax()))
    return tokens


def greedy_batch(
    model: DecoderModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, step: Any = None
) -> list[list[int]]:
    """All prompts prefilled in one packed step, then decoded together, one batched step per token."""
    run = PagedRun(model, step=step)
    logits = run.step(list(enumerate(prompts)))
    outputs = [[int(row.argmax())] for row in logits]
    while len(outputs[0]) < max_new_tokens:
        logits = run.step([(i, out[-1:]) for i, out in enumerate(outputs)])
        for out, row in zip(outputs, logits, strict=True):
            out.append(int(row.argmax()))
    return outputs


def hf_greedy(hf_model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    return out[0, len(prompt) :].tolist()


def save_hf_checkpoint(
    hf_model: Any,
    out_dir: Path,
    tokenizer_file: Path,
    drop_config_keys: Sequence[str] = (),
    **save_kwargs: Any,
) -> Path:
    """save_pretrained (safetensors) plus a tokenizer.json, optionally removing keys from config.json."""
    hf_model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    shutil.copy(tokenizer_file, out_dir / "tokenizer.json")
    if drop_config_keys:
        config = json.loads((out_dir / "config.json").read_text())
        for key in drop_config_keys:
            config.pop(key)
        (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def dense_decode(q, kv_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Each sequence's query against its first seq_len cached positions, in float64."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    slots_kv = kv_cache.double().reshape(2, num_blocks * block_size, num_kv_heads, head_dim)
    outs = []
    for s in range(num_seqs):
        positions = torch.arange(int(seq_lens[s]))
        slots = block_tables[s].long()[positions // block_size] * block_size + positions % block_size
        group = num_heads // num_kv_heads
        k = slots_kv[0, slots].repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = slots_kv[1, slots].repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[s].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", probs, v).reshape(-1))
    out = torch.stack(outs) if outs else torch.empty(0, num_heads * head_dim, dtype=torch.float64)
    return out.to(q.dtype)
