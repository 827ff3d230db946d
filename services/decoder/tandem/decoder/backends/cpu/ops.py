"""The per-op C kernels as torch custom ops: `torch.ops.tandem_<level>.<name>`, one namespace per ISA level.

Why custom ops: a call through ctypes is opaque to torch.compile, which would break its graph at
each one. Registered with a schema (what each op reads and writes) and a fake implementation (the
output shapes, computed without running anything), the call is a node a graph can hold. The fused
layer halves and the one-call decode stack are not ops: they exist to remove per-op dispatch, which
a compiled graph does not have, so only the eager executor calls them.

Why a namespace per level: a process may load more than one build (the tests run every level the
machine can run), and each op must call the build it was registered for; a process-wide "current
build" would be hidden global state. Registered through `torch.library.Library` with a plain
function: a call costs a quarter of what a `custom_op` decorator's does (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.backends.cpu.linear import CLinear

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "qkv_rope_cache": (
        "qkv_rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, int num_heads, bool want_keys) -> (Tensor, Tensor)"
    ),
    "decode_attention": (
        "decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) "
        "-> Tensor"
    ),
    "linear_bf16": "linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
}


def _fake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_qkv_rope_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    want_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    num_tokens = qkv.shape[0]
    keys = num_tokens if want_keys else 0
    return qkv.new_empty(num_tokens, num_heads, head_dim), qkv.new_empty(keys, num_kv_heads, head_dim)


def _fake_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _fake_linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


FAKES = {
    "rms_norm": _fake_rms_norm,
    "qkv_rope_cache": _fake_qkv_rope_cache,
    "decode_attention": _fake_decode_attention,
    "linear_bf16": _fake_linear_bf16,
}


def _implementations(kernels: Kernels) -> dict[str, Any]:
    def qkv_rope_cache(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # The schema's arguments, in order (SCHEMAS); an op returns a tensor where the wrapper gives
        # None, so keys not wanted come back empty, as the fake says.
        q, k = kernels.qkv_rope_cache(*args)
        qkv, kv_cache = args[0], args[6]
        return q, k if k is not None else qkv.new_empty(0, kv_cache.shape[3], kv_cache.shape[4])

    return {
        "rms_norm": kernels.rms_norm,
        "qkv_rope_cache": qkv_rope_cache,
        "decode_attention": kernels.decode_attention,
        "linear_bf16": lambda x, weight, bias: CLinear(kernels, weight, bias)(x),
    }


@cache
def register(kernels: Kernels) -> Any:
    """Registers `kernels`' ops (once per build) and returns their namespace, `torch.ops.tandem_<level>`."""
    namespace = f"tandem_{kernels.level.name}"
    library = torch.library.Library(namespace, "DEF")
    implementations = _implementations(kernels)
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, implementations[name], "CPU")
        torch.library.register_fake(f"{namespace}::{name}", FAKES[name], lib=library)
    _LIBRARIES.append(library)  # the registrations last as long as the Library object
    return getattr(torch.ops, namespace)


_LIBRARIES: list[torch.library.Library] = []
