"""A decode-only step's layers in one C call (backends/cpu/stack.py) against the per-layer fused calls.

The stack runs the same kernels in the same order as the fused layers, so its logits are the same
bits; it checks the step's tensors once.
"""

from __future__ import annotations

import pytest
import torch

from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.stack import DecodeStack
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.transformer import DecoderModel

from ...conftest import Checkpoint
from ...models.helpers import PagedRun

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]


def decode_logits(model: DecoderModel, kernels, use_stack: bool) -> list[torch.Tensor]:
    """Two prompts prefilled (per layer: a prefill step), then five decode steps of both."""
    run = PagedRun(model, step=CpuExecutor(model, kernels, linears="c", use_stack=use_stack))
    run.step([("a", PROMPT), ("b", PROMPT[:7])])
    return [run.step([("a", [token]), ("b", [token + 1])]) for token in (42, 7, 99, 5, 310)]


def test_a_one_rank_bf16_model_binds_a_stack_and_a_float32_model_does_not(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    assert isinstance(CpuExecutor(model, kernels, linears="c").stack, DecodeStack)
    assert CpuExecutor(model, None, linears="c").stack is None
    fp32 = load_model(checkpoint.path, dtype="float32").model
    assert CpuExecutor(fp32, kernels, linears="c").stack is None


def test_decode_steps_through_the_stack_give_the_per_layer_calls_bits(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    for got, want in zip(
        decode_logits(model, kernels, True), decode_logits(model, kernels, False), strict=True
    ):
        assert torch.equal(got, want)


@pytest.fixture
def stack(kernels, checkpoints: dict[str, Checkpoint]) -> tuple[DecodeStack, DecoderModel]:
    """Our Qwen3 variant in bf16, its stack bound to the C kernels."""
    model = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    bound = CpuExecutor(model, kernels, linears="c").stack
    assert bound is not None
    return bound, model


def metadata(slots: list[int], seq_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        query_lens=[1] * len(slots),
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        logits_indices=torch.arange(len(slots)),
    )


def test_the_stack_refuses_what_the_kernels_cannot_read_naming_the_argument(
    stack: tuple[DecodeStack, DecoderModel],
) -> None:
    stack, qwen3_bf16 = stack
    caches = qwen3_bf16.allocate_kv_cache(4, 4)  # 16 slots a layer
    h = torch.randn(2, stack.hidden).to(torch.bfloat16)
    cos = sin = torch.ones(2, 1, stack.head_dim, dtype=torch.bfloat16)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    good = metadata([5, 12], [2, 1], tables)

    with pytest.raises(ValueError, match="KV slot is outside kv_cache"):
        stack.run(h.clone(), cos, sin, metadata([5, 16], [2, 1], tables), caches)
    assert all(c.count_nonzero() == 0 for c in caches), "a refused slot is found before any write"
    with pytest.raises(ValueError, match=r"sequence length \(seq_lens\) or block id"):
        stack.run(h.clone(), cos, sin, metadata([5, 12], [2, 9], tables), caches)
    with pytest.raises(ValueError, match="^h must be contiguous bfloat16"):
        stack.run(h.float(), cos, sin, good, caches)
    with pytest.raises(ValueError, match="^cos must be contiguous bfloat16"):
        stack.run(h.clone(), cos.float(), sin, good, caches)
    with pytest.raises(ValueError, match=r"^block_tables must be contiguous torch.int32 \[2, 2\]"):
        stack.run(h.clone(), cos, sin, metadata([5, 12], [2, 1], tables.long()), caches)
    with pytest.raises(ValueError, match=r"^seq_lens must be contiguous torch.int32 \[2\]"):
        bad = metadata([5, 12], [2, 1], tables)
        stack.run(h.clone(), cos, sin, AttentionMetadata(bad.query_lens, bad.seq_lens, bad.seq_lens_t[:1],
                  bad.slot_mapping, tables, bad.logits_indices), caches)  # fmt: skip
    with pytest.raises(ValueError, match="^kv_caches must be"):
        stack.run(h.clone(), cos, sin, good, caches[:-1])
    # The caches are checked again whenever one is not the tensor checked last time.
    assert stack.run(h.clone(), cos, sin, good, caches).isfinite().all()
    with pytest.raises(ValueError, match="^kv_caches must be 2 contiguous bfloat16 tensors of one shape"):
        stack.run(h.clone(), cos, sin, good, [caches[0], caches[1].float()])
    with pytest.raises(ValueError, match="^kv_caches must be 2 contiguous bfloat16 tensors of one shape"):
        stack.run(h.clone(), cos, sin, good, [caches[0], qwen3_bf16.allocate_kv_cache(3, 4)[1]])
    with pytest.raises(ValueError, match=r"^kv_cache must be bfloat16 \[2, \*, \*, "):
        stack.run(h.clone(), cos, sin, good, [c[:, :, :, :1] for c in caches])
    with pytest.raises(ValueError, match="decode-only"):
        prefill = AttentionMetadata([2], [2], torch.tensor([2], dtype=torch.int32), torch.tensor([5, 6]),
                                    tables[:1], torch.tensor([1]))  # fmt: skip
        stack.run(h.clone(), cos, sin, prefill, caches)
    assert stack.run(h.clone(), cos, sin, good, caches).isfinite().all()
