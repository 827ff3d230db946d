"""The fused decoder layer (models/layer_kernels.c) against the module path it replaces.

Both halves chain the same C kernels the module path calls (norms, linears, q/k norm + RoPE + cache
write) and round every intermediate where it rounds, so a model's logits on the fused layers equal
the module path's on the same kernels; only silu's exp may differ in its last fp32 bit.
"""

from __future__ import annotations

import pytest
import torch

from services.decoder.models.linear import Linear
from services.decoder.models.loader import load_model
from services.decoder.models.native_layer import NativeLayer

from .conftest import Checkpoint
from .helpers import NEEDS_C_LINEARS, PagedRun

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]

pytestmark = NEEDS_C_LINEARS


def steps(model, fused: bool) -> list[torch.Tensor]:
    """Prefill of two sequences, a chunk with a cached prefix, then decode steps: every path."""
    saved = [layer.native for layer in model.layers]
    for layer in model.layers:
        layer.native = layer.native if fused else None
    run = PagedRun(model)
    out = [run.step([("a", PROMPT), ("b", PROMPT[:5])])]
    out.append(run.step([("b", PROMPT[5:])]))  # attends to its cached prefix
    for token in (42, 7, 99):
        out.append(run.step([("a", [token]), ("b", [token])]))
    for layer, native_layer in zip(model.layers, saved, strict=True):
        layer.native = native_layer
    return out


def test_every_layer_of_a_one_rank_bf16_model_is_fused(kernels, checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    model.use_native_kernels(kernels)
    assert all(isinstance(layer.native, NativeLayer) for layer in model.layers)
    model.use_native_kernels(None)
    assert all(layer.native is None for layer in model.layers)


def test_float32_models_keep_the_module_path(kernels, checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    model.use_native_kernels(kernels)
    assert all(layer.native is None for layer in model.layers)


def test_fused_layers_give_the_module_paths_logits(kernels, checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    model.use_native_kernels(kernels)
    assert all(m.native is not None for m in model.modules() if isinstance(m, Linear))
    assert all(layer.native is not None for layer in model.layers)
    for got, want in zip(steps(model, fused=True), steps(model, fused=False), strict=True):
        # The same kernels in the same order: equal, but for a rare last-bit silu difference.
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_slot_outside_the_cache_is_refused(kernels, checkpoints: dict[str, Checkpoint]) -> None:
    model = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    model.use_native_kernels(kernels)
    layer = model.layers[0].native
    assert layer is not None
    cache = model.allocate_kv_cache(4, 4)[0]
    h = torch.randn(2, layer.hidden).to(torch.bfloat16)
    cos = sin = torch.ones(2, 1, layer.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KV slot is outside kv_cache"):
        layer.attention_in(h, cos, sin, torch.tensor([3, 16]), cache, want_kv=False)
    assert cache.count_nonzero() == 0


def test_inputs_the_kernels_cannot_read_are_refused_naming_the_argument(
    kernels, checkpoints: dict[str, Checkpoint]
) -> None:
    model = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    model.use_native_kernels(kernels)
    layer = model.layers[0].native
    assert layer is not None
    cache = model.allocate_kv_cache(4, 4)[0]
    h = torch.randn(2, layer.hidden).to(torch.bfloat16)
    cos = sin = torch.ones(2, 1, layer.head_dim, dtype=torch.bfloat16)
    assert not layer.accepts(h.float(), cache)
    with pytest.raises(ValueError, match="^h must be contiguous bfloat16"):
        layer.attention_in(h.float(), cos, sin, torch.tensor([1, 2]), cache, want_kv=False)
    with pytest.raises(ValueError, match="^cos must be contiguous bfloat16"):
        layer.attention_in(h, cos.float(), sin, torch.tensor([1, 2]), cache, want_kv=False)
    with pytest.raises(ValueError, match=r"^slot_mapping must be int64 \[2\]"):
        layer.attention_in(h, cos, sin, torch.tensor([1, 2], dtype=torch.int32), cache, want_kv=False)
    with pytest.raises(ValueError, match="^attn must be contiguous bfloat16"):
        layer.mlp_block(h, torch.randn(2, 3).to(torch.bfloat16))
