"""Direct calls of the C kernel wrappers with careless or hostile arguments.

The C side reads through raw pointers and cannot see a buffer's length, so each wrapper checks every
tensor it passes. Hypothesis draws well-formed calls, then breaks up to two arguments (dtype, shape,
device, contiguity, an index out of range, a scalar out of range). Every call either raises a
ValueError that names a broken argument, leaving the KV cache untouched, or matches a torch reference;
well-formed calls always match. A read out of bounds would show as a crash or as a mismatch. Every
test runs on each build this machine's CPU can run (conftest.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.decoder.models.layers import RMSNorm

from ...models.helpers import dense_decode
from .test_kernels import torch_qkv_rope_cache

DTYPES = [torch.float32, torch.bfloat16]
OTHER_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
FUZZ = settings(max_examples=200, deadline=None)

Args = dict[str, Any]
Breaker = Callable[[Args, st.DataObject], Args]


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


# -- ways to break one argument --------------------------------------------------------------------


def other_dtype(t: torch.Tensor, data: st.DataObject) -> torch.Tensor:
    return t.to(data.draw(st.sampled_from([d for d in OTHER_DTYPES if d != t.dtype])))


def other_shape(t: torch.Tensor, data: st.DataObject) -> torch.Tensor:
    how = data.draw(st.sampled_from(["resize", "add_dim", "drop_dim"]))
    if how == "add_dim" or t.dim() == 0:
        return t.unsqueeze(0)
    if how == "drop_dim":
        return t.flatten(0, 1) if t.dim() > 1 else torch.zeros((), dtype=t.dtype)
    shape = list(t.shape)
    dim = data.draw(st.integers(0, t.dim() - 1))
    shape[dim] += -1 if shape[dim] > 0 and data.draw(st.booleans()) else 1
    return torch.randn(shape).to(t.dtype)


def strided(t: torch.Tensor, data: st.DataObject) -> torch.Tensor:
    """The same values, every other element of a wider buffer: not contiguous (unless trivially so)."""
    return torch.stack((t, torch.zeros_like(t)), dim=-1)[..., 0]


def on_meta(t: torch.Tensor, data: st.DataObject) -> torch.Tensor:
    return t.to("meta")  # no storage at all: its data pointer is 0


TENSOR_BREAKS = [other_dtype, other_shape, strided, on_meta]


def break_tensor(name: str) -> Breaker:
    def apply(args: Args, data: st.DataObject) -> Args:
        how = data.draw(st.sampled_from(TENSOR_BREAKS))
        return args | {name: how(args[name], data)}

    return apply


def break_scalar(name: str, *bad: Any) -> Breaker:
    def apply(args: Args, data: st.DataObject) -> Args:
        return args | {name: data.draw(st.sampled_from(bad))}

    return apply


def break_index(name: str, out_of_range: int) -> Breaker:
    """An index tensor with one used entry out of range (or its dtype, shape, device broken)."""

    def apply(args: Args, data: st.DataObject) -> Args:
        t = args[name]
        if t.numel() == 0 or data.draw(st.booleans()):
            return break_tensor(name)(args, data)
        t = t.clone()
        t.view(-1)[data.draw(st.integers(0, t.numel() - 1))] = data.draw(
            st.sampled_from([-1, out_of_range, 2**31 - 1])
        )
        return args | {name: t}

    return apply


def call_breaking(
    data: st.DataObject,
    args: Args,
    breakers: dict[str, Breaker],
    call: Callable[..., Any],
    reference: Callable[..., Any],
    compare: Callable[[Any, Any], None],
    written_in_place: str | None = None,  # an argument the call writes to (the KV cache)
) -> None:
    """Break up to two arguments, call, and check: a ValueError naming one of them, or the reference."""
    broken = data.draw(st.lists(st.sampled_from(sorted(breakers)), max_size=2, unique=True))
    for name in broken:
        args = breakers[name](args, data)
    # The reference starts from a copy of the written argument taken before the call.
    before = {} if written_in_place is None else {written_in_place: args[written_in_place].clone()}
    try:
        got = call(**args)
    except ValueError as error:
        assert broken, f"well-formed arguments refused: {error}"
        assert any(name in str(error) for name in broken), f"{error} names none of {broken}"
        for name, copy in before.items():
            assert copy.device.type == "meta" or torch.equal(args[name], copy), (
                f"a refused call wrote to {name}"
            )
        return
    compare(got, reference(**(args | before)))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within 1e-4. bf16: a few bf16 steps (the reference rounds at other points)."""
    want = want.detach()
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = 1e-4 if got.dtype == torch.float32 else 3e-2
    scale = max(1.0, float(want.float().abs().amax())) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance * scale, rtol=tolerance)


# -- rms_norm --------------------------------------------------------------------------------------


def torch_rms_norm_module(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps).to(weight.dtype)
    norm.weight.data = weight
    return norm


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_rms_norm_module(weight, eps)(x)


@FUZZ
@given(data=st.data())
def test_rms_norm_refuses_what_it_cannot_read_and_matches_torch_otherwise(kernels, data) -> None:
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    dtype = data.draw(st.sampled_from(DTYPES))
    size = data.draw(st.sampled_from([1, 2, 7, 64, 300]))
    leading = data.draw(st.lists(st.integers(0, 4), max_size=2))
    args = {"x": randn(*leading, size, dtype=dtype) * 3, "weight": randn(size, dtype=dtype), "eps": 1e-6}
    breakers = {
        "x": break_tensor("x"),
        "weight": break_tensor("weight"),
        "eps": break_scalar("eps", math.nan, math.inf, -1.0, "1e-6"),
    }
    call_breaking(data, args, breakers, kernels.rms_norm, torch_rms_norm, assert_close)


def test_rms_norm_refuses_a_weight_shorter_than_the_row(kernels) -> None:
    with pytest.raises(ValueError, match=r"weight must have shape \[64\] to match x, got \[32\]"):
        kernels.rms_norm(torch.randn(3, 64), torch.randn(32), 1e-6)


# -- qkv_rope_cache --------------------------------------------------------------------------------


def torch_qkv_reference(
    qkv, cos, sin, q_norm, k_norm, eps, kv_cache, slot_mapping, num_heads, want_keys
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q, k (with want_keys) and the cache after the write, through the torch ops of the model."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    norms = (None, None)
    if q_norm is not None:
        norms = (torch_rms_norm_module(q_norm, eps), torch_rms_norm_module(k_norm, eps))
    cache = kv_cache.clone()
    angles = (cos.view(-1, 1, head_dim), sin.view(-1, 1, head_dim))
    q, k = torch_qkv_rope_cache(qkv, *angles, *norms, cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    return q, k if want_keys else None, cache


@FUZZ
@given(data=st.data())
def test_qkv_rope_cache_refuses_what_it_cannot_read_and_matches_torch_otherwise(kernels, data) -> None:
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    dtype = data.draw(st.sampled_from(DTYPES))
    num_tokens, num_kv_heads = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 3))
    num_heads = num_kv_heads * data.draw(st.integers(1, 3))
    head_dim = data.draw(st.sampled_from([2, 4, 8, 64, 128]))
    block_size = data.draw(st.integers(1, 5))
    num_blocks = -(-num_tokens // block_size) + data.draw(st.integers(0, 2))
    slots = data.draw(st.permutations(range(num_blocks * block_size)))[:num_tokens]
    angles = randn(num_tokens, 1, head_dim, dtype=torch.float32) * 20
    if data.draw(st.booleans()):
        angles = angles.view(num_tokens, head_dim)
    with_norms = data.draw(st.booleans())
    args = {
        "qkv": randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype),
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        "q_norm": randn(head_dim, dtype=dtype) if with_norms else None,
        "k_norm": randn(head_dim, dtype=dtype) if with_norms else None,
        "eps": 1e-6,
        "kv_cache": randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "num_heads": num_heads,
        "want_keys": data.draw(st.booleans()),
    }
    breakers = {
        name: break_tensor(name)
        for name in ("qkv", "cos", "sin", "kv_cache") + ("q_norm", "k_norm") * with_norms
    }
    num_slots = num_blocks * block_size
    breakers |= {
        "slot_mapping": break_index("slot_mapping", num_slots),
        "num_heads": break_scalar("num_heads", 0, -1, num_heads + 1, 2.0, True),
        "eps": break_scalar("eps", math.nan, -math.inf, -1.0),
    }

    def call(**a: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return (*kernels.qkv_rope_cache(**a), a["kv_cache"])

    def compare(got, want) -> None:
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if g is not None:
                assert_close(g, w)

    call_breaking(data, args, breakers, call, torch_qkv_reference, compare, written_in_place="kv_cache")


def test_qkv_rope_cache_refuses_norm_weights_of_another_dtype(kernels) -> None:
    cache = torch.zeros(2, 2, 4, 1, 64, dtype=torch.bfloat16)
    qkv = torch.randn(1, 3 * 64).bfloat16()
    angles = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    norm = torch.ones(64)  # float32 next to bfloat16 activations
    with pytest.raises(
        ValueError, match="q_norm must be torch.bfloat16 to match kv_cache, got torch.float32"
    ):
        kernels.qkv_rope_cache(
            qkv, angles, angles, norm, norm.bfloat16(), 1e-6, cache, torch.tensor([3]), 1, False
        )
    assert cache.count_nonzero() == 0


# -- decode_attention ------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_decode_attention_refuses_what_it_cannot_read_and_matches_torch_otherwise(kernels, data) -> None:
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    dtype = data.draw(st.sampled_from(DTYPES))
    num_seqs, num_kv_heads = data.draw(st.integers(0, 4)), data.draw(st.integers(1, 3))
    num_heads = num_kv_heads * data.draw(st.integers(1, 4))
    head_dim = data.draw(st.sampled_from([1, 3, 8, 64, 128]))
    block_size, num_blocks = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 8))
    seq_lens = [data.draw(st.integers(1, 3 * block_size)) for _ in range(num_seqs)]
    max_blocks = max((-(-n // block_size) for n in seq_lens), default=0) + data.draw(st.integers(0, 2))
    tables = [[data.draw(st.integers(0, num_blocks - 1)) for _ in range(max_blocks)] for _ in range(num_seqs)]
    args = {
        "q": randn(num_seqs, num_heads, head_dim, dtype=dtype),
        "kv_cache": randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype),
        "block_tables": torch.tensor(tables, dtype=torch.int32).view(num_seqs, max_blocks),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": head_dim**-0.5,
    }
    breakers = {
        "q": break_tensor("q"),
        "kv_cache": break_tensor("kv_cache"),
        "block_tables": break_index("block_tables", num_blocks),
        "seq_lens": break_index("seq_lens", max_blocks * block_size + 1),
        "scale": break_scalar("scale", math.nan, math.inf, None),
    }
    call_breaking(data, args, breakers, kernels.decode_attention, dense_decode, assert_close)


def test_decode_attention_refuses_a_query_head_dim_other_than_the_cache(kernels) -> None:
    cache = torch.zeros(2, 2, 4, 1, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"q must have shape \[\*, \*, 64\] to match kv_cache, got \[1, 1, 128\]"
    ):
        kernels.decode_attention(torch.zeros(1, 1, 128), cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="q must be torch.float32 to match kv_cache, got torch.bfloat16"):
        kernels.decode_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16), cache, tables, lens, 0.1)
