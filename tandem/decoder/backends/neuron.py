"""Neuron decode buckets: one `torch_neuronx.trace` graph per bucket. EXPERIMENTAL: never run on hardware.

Reachable only when torch_neuronx imports, which it does on no machine this repository is tested on: the
tests drive this class with a stand-in for the SDK (tests/unit/decoder/backends/test_backend.py).
docs/BACKENDS.md says what was and was not run on real hardware.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tandem.decoder.backends.backend import Backend, RecompileError, StepFn, import_neuron
from tandem.decoder.models.attention import AttentionMetadata


class NeuronTracedBuckets:
    """Neuron: one `torch_neuronx.trace` graph per decode bucket, built at warmup.

    The traced graph takes tensors only, so the bucket's host-side
    attention lists are rebuilt inside (a decode bucket has one query per sequence, and the decode
    attention reads lengths from `seq_lens_t` only). The graph returns the written KV caches, which
    are copied back into the engine's cache: a deployment that keeps the cache on the device needs
    NxD's input/output aliasing instead, which this class does not do.
    """

    def __init__(self, backend: Backend, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self.neuronx = import_neuron(backend.name)
        self.model = model
        self.kv_caches = kv_caches
        self.num_graphs = 0
        self.compile_s = 0.0
        self.num_calls = 0
        self.is_sealed = False
        self._graphs: dict[tuple[int, int], Callable[..., tuple[torch.Tensor, ...]]] = {}

    def bucket(self) -> StepFn:
        return self._run

    def seal(self) -> None:
        self.is_sealed = True

    def _run(self, input_ids, positions, attn, kv_caches, inputs_embeds, is_token_ids) -> torch.Tensor:
        num_seqs = len(attn.query_lens)
        key = (num_seqs, attn.block_tables.shape[1])
        tensors = (
            input_ids,
            positions,
            attn.seq_lens_t,
            attn.slot_mapping,
            attn.block_tables,
            attn.logits_indices,
            inputs_embeds,
            is_token_ids,
        )
        self.num_calls += 1
        graph = self._graphs.get(key)
        if graph is None:
            if self.is_sealed:
                raise RecompileError(f"decode bucket {key} was not traced at warmup")
            model = self.model

            def step(ids, pos, lens, slots, tables, rows, embeds, is_token, *caches):
                meta = AttentionMetadata(
                    query_lens=[1] * num_seqs,
                    seq_lens=[1] * num_seqs,  # placeholders: decode attention reads seq_lens_t
                    seq_lens_t=lens,
                    slot_mapping=slots,
                    block_tables=tables,
                    logits_indices=rows,
                )
                logits = model(ids, pos, meta, list(caches), embeds, is_token)
                return (logits, *caches)

            start = time.perf_counter()
            graph = self._graphs[key] = self.neuronx.trace(step, (*tensors, *kv_caches))
            self.num_graphs += 1
            self.compile_s += time.perf_counter() - start
        logits, *written = graph(*tensors, *kv_caches)
        for cache, new in zip(kv_caches, written, strict=True):
            cache.copy_(new)
        return logits
