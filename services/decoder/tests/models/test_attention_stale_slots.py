"""No attention path reads a KV slot that its sequence does not own.

A request whose values overflow the model dtype leaves NaN or inf keys and values in its blocks, and
they stay there once the blocks are freed; padding tokens write to the null block. So each test fills
the whole cache (every block, the null block included) with NaN or inf before a sequence writes its
own keys and values, and asks for bit-for-bit the output of the same steps over a zeroed cache, on
every path: torch decode, torch prefill over a cached prefix, the C kernel, and the torch fallback
for shapes past the kernel's limits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tandem.decoder.backends.cpu import kernels as cpu_kernels
from tandem.decoder.backends.cpu.attention import CpuPagedAttention
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.limits import Limits
from tandem.decoder.backends.cpu.ops import register
from tandem.decoder.models.attention import write_kv_cache
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.torch_attention import TorchPagedAttention

from ..conftest import Checkpoint
from .helpers import PagedAllocator, PagedRun

POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


# Shapes the C kernel takes, and shapes past each of its limits (the step then runs torch ops), given
# the limits of the build this CPU loads.
SHAPES: dict[str, Callable[[Limits], Shape]] = {
    "fp32": lambda _: Shape(4, 2, 8, 4, torch.float32),
    "bf16": lambda _: Shape(4, 2, 64, 4, torch.bfloat16),
    "fp16": lambda _: Shape(4, 2, 8, 4, torch.float16),  # no C kernel for float16
    "block-past-limit": lambda limits: Shape(4, 2, 8, 2 * limits.max_block_size, torch.float32),
    "head-dim-past-limit": lambda limits: Shape(2, 1, 2 * limits.max_head_dim, 4, torch.bfloat16),
    "group-past-limit": lambda limits: Shape(2 * limits.max_group, 1, 8, 4, torch.float32),
}


def loaded() -> cpu_kernels.Kernels:
    kernels = cpu_kernels.load_for_cpu()
    assert kernels is not None, "the C kernels are built when the project is installed (make setup)"
    return kernels


# Fresh prompts, then chunks over a cached prefix (a prefill that reads the cache), then decodes
# with ragged lengths, so block tables are padded with the null block and last blocks are partial.
STEPS = [
    [("a", 6), ("b", 3), ("c", 1)],
    [("a", 3), ("b", 7)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
]


@pytest.fixture(params=["torch", "native"])
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.Kernels | None:
    return None if request.param == "torch" else loaded()


def attend_steps(
    shape: Shape, fill: float, kernels: cpu_kernels.Kernels | None, num_blocks: int = 16
) -> list[torch.Tensor]:
    """Each step's attention output, over a cache that starts with every element equal to `fill`."""
    torch.manual_seed(0)
    allocator = PagedAllocator(num_blocks=num_blocks, block_size=shape.block_size)
    kv_cache = torch.full(
        (2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim), fill, dtype=shape.dtype
    )
    attention = (
        TorchPagedAttention() if kernels is None else CpuPagedAttention(register(kernels), kernels.limits)
    )
    outs = []
    for chunks in STEPS:
        attn = allocator.metadata(chunks)
        num_tokens = sum(n for _, n in chunks)
        q = torch.randn(num_tokens, shape.num_heads, shape.head_dim).to(shape.dtype)
        k = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim).to(shape.dtype)
        v = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim).to(shape.dtype)
        write_kv_cache(kv_cache, k, v, attn.slot_mapping)
        outs.append(attention(q, k, v, kv_cache, attn, shape.head_dim**-0.5))
    return outs


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_a_cache_full_of_nan_or_inf_gives_the_clean_cache_output_on_every_path(
    kernels: cpu_kernels.Kernels | None, shape_name: str, poison: str
) -> None:
    shape = SHAPES[shape_name](loaded().limits)
    clean = attend_steps(shape, 0.0, kernels)
    poisoned = attend_steps(shape, POISONS[poison], kernels)
    for step, (got, want) in enumerate(zip(poisoned, clean, strict=True)):
        assert torch.isfinite(got).all(), f"step {step}: stale slots reached the output"
        assert torch.equal(got, want), f"step {step}"


@pytest.mark.parametrize(
    ("dtype", "use_kernels"),
    [("float16", False), ("bfloat16", False), ("bfloat16", True), ("float32", True)],
)
def test_a_request_after_one_that_left_nan_in_the_cache_gets_the_clean_cache_logits(
    checkpoints: dict[str, Checkpoint], dtype: str, use_kernels: bool
) -> None:
    # The reported failure: every KV slot NaN (as a freed block of an overflowing request leaves it),
    # then an unrelated greedy request: its tokens must not become 0 with NaN logprobs.
    model = load_model(checkpoints["qwen3"].path, dtype=dtype).model
    step = CpuExecutor(model, cpu_kernels.load_for_cpu()) if use_kernels else model
    prompt = [17, 402, 33, 981, 5, 250, 250, 731, 64]
    runs = {}
    for name, fill in (("clean", 0.0), ("poisoned", float("nan"))):
        run = PagedRun(model, num_blocks=32, step=step)
        for cache in run.kv_caches:
            cache.fill_(fill)
        # A prompt in two chunks (the second attends to a cached prefix), then three decode steps.
        logits = [run.step([("s", prompt[:5])]), run.step([("s", prompt[5:])])]
        logits += [run.step([("s", [t])]) for t in (42, 7, 99)]
        runs[name] = logits
    for got, want in zip(runs["poisoned"], runs["clean"], strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
