"""CudaPagedAttention's compiled FlexAttention kernels against a dense fp64 reference, on the GPU.

What only a GPU can show: the Triton kernels read just the listed blocks of a pool whose other slots
are NaN, bf16 stays within bf16 error of the reference, the split-KV decoding kernel (taken for a
static batch, as in a CUDA-graph bucket; decode folds each KV group into rows, so any group qualifies)
agrees too, and a decode step captured as a CUDA graph replays with new lengths and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from tandem.decoder.backends.cuda_attention import CudaPagedAttention
from tandem.decoder.models.attention import AttentionMetadata, PagedAttention, write_kv_cache
from tandem.decoder.models.flex_attention import FlexPagedAttention

pytestmark = pytest.mark.gpu

BLOCK_SIZE, NUM_BLOCKS = 16, 96
CUDA = torch.device("cuda")


@dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int


SMOLLM2 = Heads(9, 3, 64)  # a group of 3 (prefill: FlexAttention's GQA takes it on the main kernel)
QWEN = Heads(16, 8, 128)  # a group of 2 and head_dim 128


class Pool:
    """A KV pool on the GPU, sequences given shuffled blocks, and what each sequence wrote (fp32)."""

    def __init__(self, heads: Heads, dtype: torch.dtype, fill: float) -> None:
        self.heads, self.dtype = heads, dtype
        self.kv_cache = torch.full(
            (2, NUM_BLOCKS, BLOCK_SIZE, heads.num_kv_heads, heads.head_dim), fill, dtype=dtype, device=CUDA
        )
        self.free = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    def step(self, chunks: list[tuple[str, int]]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """Writes random keys and values for the chunks; returns the step's metadata and its k, v."""
        h = self.heads
        query_lens, seq_lens, slots = [], [], []
        for key, n in chunks:
            start = self.keys[key].shape[0] if key in self.keys else 0
            blocks = self.blocks.setdefault(key, [])
            while len(blocks) * BLOCK_SIZE < start + n:
                blocks.append(self.free.pop())
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
        num_tokens = sum(query_lens)
        k = torch.randn(num_tokens, h.num_kv_heads, h.head_dim, device=CUDA).to(self.dtype)
        v = torch.randn(num_tokens, h.num_kv_heads, h.head_dim, device=CUDA).to(self.dtype)
        offset = 0
        for key, n in chunks:
            self.keys[key] = torch.cat((self.keys.get(key, k[:0]), k[offset : offset + n]))
            self.values[key] = torch.cat((self.values.get(key, v[:0]), v[offset : offset + n]))
            offset += n
        width = max(len(self.blocks[key]) for key, _ in chunks)
        tables = [self.blocks[key] + [0] * (width - len(self.blocks[key])) for key, _ in chunks]
        attn = AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=CUDA),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=CUDA),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=CUDA),
            logits_indices=torch.arange(len(chunks), device=CUDA),
        )
        write_kv_cache(self.kv_cache, k, v, attn.slot_mapping)
        return attn, k, v

    def reference(self, q: torch.Tensor, chunks: list[tuple[str, int]], scale: float) -> torch.Tensor:
        """fp64 causal attention of each chunk's queries over its own keys: [num_tokens, heads * hd]."""
        group = self.heads.num_heads // self.heads.num_kv_heads
        outs, offset = [], 0
        for key, n in chunks:
            k = self.keys[key].double().repeat_interleave(group, dim=1)  # [seq_len, heads, hd]
            v = self.values[key].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[offset : offset + n].double(), k) * scale
            seq_len = k.shape[0]
            is_future = torch.ones(n, seq_len, dtype=torch.bool, device=CUDA).triu(seq_len - n + 1)
            probs = scores.masked_fill(is_future, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))
            offset += n
        return torch.cat(outs)


STEPS = [
    [("a", 40), ("b", 7), ("c", 1)],  # fresh prompts of several lengths
    [("a", 1), ("b", 30), ("c", 1), ("d", 16)],  # decodes mixed with a chunk over a cached prefix
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],  # decode-only: ragged contexts, partial and full blocks
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
]


def _run(attention: PagedAttention, heads: Heads, dtype: torch.dtype, fill: float) -> list[tuple]:
    """Each step's output and fp64 reference, over a pool that starts with every slot equal to `fill`."""
    torch.manual_seed(0)
    pool = Pool(heads, dtype, fill)
    scale = heads.head_dim**-0.5
    results = []
    for chunks in STEPS:
        attn, k, v = pool.step(chunks)
        q = torch.randn(sum(attn.query_lens), heads.num_heads, heads.head_dim, device=CUDA).to(dtype)
        out = attention(q, k, v, pool.kv_cache, attn, scale)
        results.append((out, pool.reference(q, chunks, scale)))
    return results


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(
    ("heads", "dtype"), [(SMOLLM2, torch.bfloat16), (SMOLLM2, torch.float32), (QWEN, torch.bfloat16)]
)
def test_compiled_flex_attention_matches_the_fp64_reference_over_a_nan_pool(
    heads: Heads, dtype: torch.dtype
) -> None:
    attention = CudaPagedAttention()
    clean = _run(attention, heads, dtype, 0.0)
    poisoned = _run(attention, heads, dtype, float("nan"))
    # bf16 operands with fp32 accumulation; fp32 far under TF32's ~1e-3 (the engine's fp32 parity needs it)
    bound = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for step, ((got, ref), (clean_out, _)) in enumerate(zip(poisoned, clean, strict=True)):
        assert got.dtype == dtype and torch.isfinite(got).all(), (
            f"step {step}: a stale slot reached the output"
        )
        assert _relative_error(got, ref) < bound, f"step {step}"
        assert torch.equal(got, clean_out), f"step {step}: the NaN pool changed the output"


@pytest.mark.parametrize("heads", [SMOLLM2, QWEN])
def test_the_split_kv_decoding_kernel_of_a_static_batch_matches_the_reference(heads: Heads) -> None:
    # dynamic=False: a static batch, as in a CUDA-graph bucket, lets FlexAttention pick flex decoding.
    attention = FlexPagedAttention(torch.compile(flex_attention, dynamic=False, fullgraph=True))
    for step, (got, ref) in enumerate(_run(attention, heads, torch.bfloat16, float("nan"))):
        assert torch.isfinite(got).all() and _relative_error(got, ref) < 1e-2, f"step {step}"


def test_a_decode_step_captured_as_a_cuda_graph_replays_with_new_lengths_and_tables() -> None:
    torch.manual_seed(0)
    heads, dtype = SMOLLM2, torch.bfloat16
    attention = FlexPagedAttention(torch.compile(flex_attention, dynamic=False, fullgraph=True))
    pool = Pool(heads, dtype, float("nan"))
    pool.step([("a", 20), ("b", 50), ("c", 3)])
    first, _, _ = pool.step([("a", 1), ("b", 1), ("c", 1)])
    # Static inputs of the graph: the second decode step's shapes, tables padded to 6 blocks.
    tables = torch.zeros(3, 6, dtype=torch.int32, device=CUDA)
    tables[:, : first.block_tables.shape[1]] = first.block_tables
    static = AttentionMetadata(
        first.query_lens,
        first.seq_lens,
        first.seq_lens_t.clone(),
        first.slot_mapping,
        tables,
        first.logits_indices,
    )
    q = torch.randn(3, heads.num_heads, heads.head_dim, device=CUDA).to(dtype)
    scale = heads.head_dim**-0.5
    attention(q, None, None, pool.kv_cache, static, scale)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, None, None, pool.kv_cache, static, scale)
    for _ in range(2):  # two more decode steps: longer contexts, "b" gains a block
        attn, _, _ = pool.step([("a", 1), ("b", 1), ("c", 1)])
        static.seq_lens_t.copy_(attn.seq_lens_t)
        tables.zero_()
        tables[:, : attn.block_tables.shape[1]] = attn.block_tables
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        graph.replay()
        assert torch.isfinite(out).all()
        assert _relative_error(out, pool.reference(q, [("a", 1), ("b", 1), ("c", 1)], scale)) < 1e-2
