"""A decoder layer's two fused C halves (backends/cpu/layer.py) against the model's own module path.

The C linears run on every x86 CPU (an AVX-512 machine runs the AVX2 code), so these tests force
them where the executor would choose oneDNN.
"""

from __future__ import annotations

import pytest
import torch

from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.layer import FusedLayer
from tandem.decoder.models.loader import load_model

from ...conftest import Checkpoint
from ...models.helpers import PagedRun

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]


def steps(model, step) -> list[torch.Tensor]:
    """Prefill of two sequences, a chunk with a cached prefix, then decode steps: every path."""
    run = PagedRun(model, step=step)
    out = [run.step([("a", PROMPT), ("b", PROMPT[:5])])]
    out.append(run.step([("b", PROMPT[5:])]))  # attends to its cached prefix
    for token in (42, 7, 99):
        out.append(run.step([("a", [token]), ("b", [token])]))
    return out


def fused_layer(kernels, checkpoints: dict[str, Checkpoint]) -> tuple[FusedLayer, torch.Tensor]:
    model = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    executor = CpuExecutor(model, kernels, linears="c")
    assert executor.fused is not None
    return executor.fused[0], model.allocate_kv_cache(4, 4)[0]


def test_every_layer_of_a_one_rank_bf16_model_is_fused_and_a_float32_one_is_not(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    executor = CpuExecutor(model, kernels, linears="c")
    assert executor.fused is not None and all(isinstance(f, FusedLayer) for f in executor.fused)
    fp32 = load_model(checkpoint.path, dtype="float32").model
    assert CpuExecutor(fp32, kernels, linears="c").fused is None


def test_fused_layers_give_the_module_paths_logits(kernels, checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    fused = CpuExecutor(model, kernels, linears="c", use_stack=False)
    assert fused.choice.fused_layers
    per_op = CpuExecutor(model, kernels, linears="torch")
    for got, want in zip(steps(model, fused), steps(model, per_op), strict=True):
        # The same numerics up to the order of fp32 sums and silu's exp.
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_slot_outside_the_cache_is_refused(kernels, checkpoints: dict[str, Checkpoint]) -> None:
    layer, cache = fused_layer(kernels, checkpoints)
    h = torch.randn(2, layer.hidden).to(torch.bfloat16)
    cos = sin = torch.ones(2, 1, layer.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KV slot is outside kv_cache"):
        layer.attention_in(h, cos, sin, torch.tensor([3, 16]), cache, want_kv=False)
    assert cache.count_nonzero() == 0


def test_inputs_the_kernels_cannot_read_are_refused_naming_the_argument(
    kernels, checkpoints: dict[str, Checkpoint]
) -> None:
    layer, cache = fused_layer(kernels, checkpoints)
    h = torch.randn(2, layer.hidden).to(torch.bfloat16)
    cos = sin = torch.ones(2, 1, layer.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^h must be contiguous bfloat16"):
        layer.attention_in(h.float(), cos, sin, torch.tensor([1, 2]), cache, want_kv=False)
    with pytest.raises(ValueError, match="^cos must be contiguous bfloat16"):
        layer.attention_in(h, cos.float(), sin, torch.tensor([1, 2]), cache, want_kv=False)
    with pytest.raises(ValueError, match=r"^slot_mapping must be int64 \[2\]"):
        layer.attention_in(h, cos, sin, torch.tensor([1, 2], dtype=torch.int32), cache, want_kv=False)
    with pytest.raises(ValueError, match="^attn must be contiguous bfloat16"):
        layer.mlp_block(h, torch.randn(2, 3).to(torch.bfloat16))
