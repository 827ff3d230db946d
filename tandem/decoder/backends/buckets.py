"""Which compile-bucket kind a backend uses: `torch.compile` (CPU, CUDA) or the Neuron tracer."""

from __future__ import annotations

import torch

from tandem.decoder.backends.backend import Backend
from tandem.decoder.backends.neuron import NeuronTracedBuckets
from tandem.decoder.backends.torch_compile import TorchCompileBuckets

BucketCompiler = TorchCompileBuckets | NeuronTracedBuckets


def bucket_compiler(
    backend: Backend, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_buckets: int
) -> BucketCompiler:
    """How this backend turns each static-shape decode bucket into a compiled graph."""
    if backend.compile_mode is None:
        return NeuronTracedBuckets(backend, model, kv_caches)
    return TorchCompileBuckets(backend, model, kv_caches, max_num_buckets)
