"""FlexPagedAttention (the CUDA implementation's code) on CPU: its block masks, stale slots, the C kernel.

FlexAttention's eager path applies mask_mod to the whole KV pool and ignores the block lists, while
its compiled kernels (Triton on the GPU) read only the listed blocks and skip mask_mod on full ones.
So the outputs here (compared with the dense reference in test_attention.py) prove the mask_mod, and
the block-list tests below prove what the kernels add: every visible slot is in a listed block, a full
block is wholly visible, no block is listed twice, and every slot of a listed block holds a finite
value once the step has cleared its stale tails.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tandem.decoder.backends.cpu.attention import CpuPagedAttention
from tandem.decoder.backends.cpu.kernels import load_for_cpu
from tandem.decoder.backends.cpu.ops import register
from tandem.decoder.models.attention import AttentionMetadata, write_kv_cache
from tandem.decoder.models.flex_attention import FlexPagedAttention
from tandem.decoder.models.flex_block_mask import Q_BLOCK_SIZE, decode_block_mask, prefill_block_mask
from tandem.decoder.models.loader import load_model

from ..conftest import Checkpoint
from .helpers import PagedAllocator, greedy, greedy_batch

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BLOCK_SIZE, NUM_BLOCKS = 4, 32


def _visible_slots(attn: AttentionMetadata, seq: int, position: int) -> set[int]:
    """The pool slots of sequence `seq` at logical positions 0..position (the reference rule)."""
    table = attn.block_tables[seq].tolist()
    return {table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(position + 1)}


def _check_block_lists(
    mask: BlockMask,
    rows: list[tuple[int, int, int, int]],  # (batch, row, sequence, position) of every real query row
    attn: AttentionMetadata,
) -> None:
    """mask_mod against the reference rule, and the block lists against mask_mod, for every real row."""
    num_slots = NUM_BLOCKS * BLOCK_SIZE
    kv = torch.arange(num_slots)
    q_block_size = mask.BLOCK_SIZE[0]
    for b, row, seq, position in rows:
        visible = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(row), kv)  # [num_slots]
        expected = _visible_slots(attn, seq, position)
        assert set(torch.nonzero(visible).flatten().tolist()) == expected, (seq, position)
        q_block = row // q_block_size
        partial = mask.kv_indices[b, 0, q_block, : int(mask.kv_num_blocks[b, 0, q_block])].tolist()
        assert mask.full_kv_num_blocks is not None and mask.full_kv_indices is not None
        full = mask.full_kv_indices[b, 0, q_block, : int(mask.full_kv_num_blocks[b, 0, q_block])].tolist()
        listed = partial + full
        assert len(listed) == len(set(listed)), f"a block listed twice for row {row}"
        assert {slot // BLOCK_SIZE for slot in expected} <= set(listed)
        for block in full:  # the kernels skip mask_mod here: every slot must be visible
            assert set(range(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)) <= expected


def _prefix_sharing_step() -> AttentionMetadata:
    """Two sequences sharing their first two blocks (a cached prefix), decoding or prefilling."""
    allocator = PagedAllocator(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    allocator.metadata([("a", 9)])
    allocator.blocks["b"] = allocator.blocks["a"][:2]  # b reuses a's first 8 positions
    allocator.seq_lens["b"] = 8
    return allocator.metadata([("a", 1), ("b", 6), ("c", 3)])


def test_decode_block_lists_cover_exactly_what_each_query_sees() -> None:
    allocator = PagedAllocator(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    allocator.metadata([("a", 7), ("b", 8), ("c", 1), ("d", 13)])
    attn = allocator.metadata([("a", 1), ("b", 1), ("c", 1), ("d", 1)])  # 8, 9, 2 and 14 positions
    group = 3
    mask = decode_block_mask(attn.seq_lens_t, attn.block_tables, NUM_BLOCKS, BLOCK_SIZE, group)
    rows = [(s, g, s, n - 1) for s, n in enumerate(attn.seq_lens) for g in range(group)]
    _check_block_lists(mask, rows, attn)


def test_decode_block_lists_of_static_padding_sequences_read_the_null_block_only() -> None:
    tables = torch.tensor([[5, 6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    attn = AttentionMetadata(
        query_lens=[1, 1, 1],
        seq_lens=[6, 1, 1],
        seq_lens_t=torch.tensor([6, 1, 1], dtype=torch.int32),
        slot_mapping=torch.tensor([21, 0, 0]),
        block_tables=tables,
        logits_indices=torch.arange(3),
    )
    mask = decode_block_mask(attn.seq_lens_t, tables, NUM_BLOCKS, BLOCK_SIZE, group=2)
    _check_block_lists(mask, [(s, 0, s, n - 1) for s, n in enumerate(attn.seq_lens)], attn)


def test_prefill_block_lists_cover_exactly_what_each_query_sees_with_shared_prefix_blocks() -> None:
    attn = _prefix_sharing_step()
    aligned = prefill_block_mask(
        attn.query_lens, attn.seq_lens, attn.seq_lens_t, attn.block_tables, NUM_BLOCKS, BLOCK_SIZE
    )
    assert aligned.num_rows == Q_BLOCK_SIZE * 3  # each sequence's rows start a query block
    rows, token = [], 0
    for seq, (query_len, seq_len) in enumerate(zip(attn.query_lens, attn.seq_lens, strict=True)):
        for j in range(query_len):
            rows.append((0, int(aligned.rows[token]), seq, seq_len - query_len + j))
            token += 1
    _check_block_lists(aligned.block_mask, rows, attn)


def test_a_long_prefill_chunk_splits_into_query_blocks_with_their_own_full_blocks() -> None:
    allocator = PagedAllocator(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    allocator.metadata([("a", 23)])
    attn = allocator.metadata([("a", 37)])  # queries at positions 23..59: three query blocks
    aligned = prefill_block_mask(
        attn.query_lens, attn.seq_lens, attn.seq_lens_t, attn.block_tables, NUM_BLOCKS, BLOCK_SIZE
    )
    mask = aligned.block_mask
    assert mask.full_kv_num_blocks is not None
    assert mask.full_kv_num_blocks[0, 0].tolist() == [6, 10, 14]  # blocks before positions 23, 39, 55
    assert mask.kv_num_blocks[0, 0].tolist() == [4, 4, 1]  # up to positions 38, 54, 59
    rows = [(0, int(aligned.rows[j]), 0, 23 + j) for j in range(37)]
    _check_block_lists(mask, rows, attn)


def test_a_cache_full_of_nan_is_finite_in_every_listed_block_after_each_step_and_live_slots_keep() -> None:
    torch.manual_seed(0)
    num_kv_heads, head_dim = 2, 8
    allocator = PagedAllocator(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"))
    attention = FlexPagedAttention(flex=lambda q, k, v, **_: q)  # the kernel itself is not under test
    steps = [[("a", 6), ("b", 3), ("c", 1)], [("a", 3), ("b", 7)], [("a", 1), ("b", 1), ("c", 1)]]
    for chunks in steps:
        attn = allocator.metadata(chunks)
        num_tokens = sum(n for _, n in chunks)
        k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim)
        write_kv_cache(kv_cache, k, v, attn.slot_mapping)
        live = kv_cache.clone()
        attention(torch.randn(num_tokens, 4, head_dim), k, v, kv_cache, attn, 1.0)
        for seq, seq_len in enumerate(attn.seq_lens):
            blocks = attn.block_tables[seq, : -(-seq_len // BLOCK_SIZE)]
            assert torch.isfinite(kv_cache[:, blocks]).all(), f"sequence {seq} would read a NaN"
            slots = torch.tensor(sorted(_visible_slots(attn, seq, seq_len - 1)))
            flat, before = (
                kv_cache.view(2, -1, num_kv_heads, head_dim),
                live.view(2, -1, num_kv_heads, head_dim),
            )
            assert torch.equal(flat[:, slots], before[:, slots]), "a live slot was cleared"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_decode_matches_the_c_kernel_and_the_fp64_reference_on_one_cache(dtype: torch.dtype) -> None:
    # SmolLM2's attention shape: 9 query heads over 3 KV heads, head_dim 64, blocks of 16.
    kernels = load_for_cpu()
    assert kernels is not None, "the C kernels are built when the project is installed (make setup)"
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    allocator = PagedAllocator(num_blocks=num_blocks, block_size=block_size)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 1e3).to(dtype)
    lengths = {"a": 1, "b": 16, "c": 70, "d": 200}
    attn = allocator.metadata(list(lengths.items()))
    k, v = torch.randn(2, sum(lengths.values()), num_kv_heads, head_dim).to(dtype)
    write_kv_cache(kv_cache, k, v, attn.slot_mapping)
    attn = allocator.metadata([(key, 1) for key in lengths])
    k_new, v_new = torch.randn(2, len(lengths), num_kv_heads, head_dim).to(dtype)
    write_kv_cache(kv_cache, k_new, v_new, attn.slot_mapping)
    q = torch.randn(len(lengths), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    flex = FlexPagedAttention()(q, None, None, kv_cache, attn, scale)
    c_kernel = CpuPagedAttention(register(kernels), kernels.limits)(q, None, None, kv_cache, attn, scale)
    refs, start = [], 0
    for i, (n, q_i) in enumerate(zip(lengths.values(), q, strict=True)):
        keys = torch.cat((k[start : start + n], k_new[i : i + 1])).float()
        values = torch.cat((v[start : start + n], v_new[i : i + 1])).float()
        refs.append(_dense(q_i[None].float(), keys, values, scale))
        start += n
    ref = torch.cat(refs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for out in (flex, c_kernel):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(flex.float(), c_kernel.float(), atol=tolerance, rtol=tolerance)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64 attention of q [1, heads, hd] over all of k, v [n, kv_heads, hd] -> [1, heads * hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    probs = (torch.einsum("qhd,khd->hqk", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(1, -1).float()


def test_inductor_compiled_decode_reads_only_the_listed_blocks_of_a_nan_pool() -> None:
    # A real block-sparse kernel (Inductor's CPU template) over a pool of NaN: finite, and the fp64
    # reference. The CPU lowering wants block lists as wide as the pool, hence tables of NUM_BLOCKS.
    # Only decode: torch 2.13's CPU template fails to build the prefill mask (a C++ codegen error).
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"))
    lengths = [9, 4, 1, 14]
    blocks = (torch.randperm(NUM_BLOCKS - 1) + 1).tolist()
    tables = torch.zeros(len(lengths), NUM_BLOCKS, dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(lengths):
        owned = [blocks.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables[i, : len(owned)] = torch.tensor(owned)
        k, v = torch.randn(2, n, num_kv_heads, head_dim)
        slots = torch.tensor([owned[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
        write_kv_cache(kv_cache, k, v, slots)
        keys.append(k)
        values.append(v)
    attn = AttentionMetadata(
        query_lens=[1] * len(lengths),
        seq_lens=lengths,
        seq_lens_t=torch.tensor(lengths, dtype=torch.int32),
        slot_mapping=torch.zeros(len(lengths), dtype=torch.int64),  # written above
        block_tables=tables,
        logits_indices=torch.arange(len(lengths)),
    )
    q = torch.randn(len(lengths), num_heads, head_dim)
    scale = head_dim**-0.5
    out = FlexPagedAttention(torch.compile(flex_attention, fullgraph=True))(
        q, None, None, kv_cache, attn, scale
    )
    ref = torch.cat([_dense(q[i : i + 1], keys[i], values[i], scale) for i in range(len(lengths))])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_model_gives_the_same_greedy_tokens_through_flex_attention_alone_and_batched(
    checkpoints: dict[str, Checkpoint],
) -> None:
    # Qwen3: GQA, per-head norms, a tied head. Eager FlexAttention is slow on CPU: one variant.
    model = load_model(checkpoints["qwen3"].path, dtype="float32").model
    prompts = [[17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88], [901, 2, 45], [7]]
    expected = [greedy(model, p, 8) for p in prompts]
    model.use_attention(FlexPagedAttention())
    assert [greedy(model, p, 8) for p in prompts] == expected
    assert greedy_batch(model, prompts, 8) == expected
