"""The fused copy and digest of a shared-memory segment (csrc/copy_digest.c through copy_digest.py):
its copy is the source and its tag is `shm_digest.keyed_digest` of it bit for bit, in both forms,
at every length and alignment; a CPU without carry-less multiplication keeps the two-pass read."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.client.errors import InvalidArgument
from tandem.common.torch_part import shared_memory, shm_digest, shm_pool, shm_segment_maps, tensors
from tandem.decoder.backends.cpu import copy_digest
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernels import Kernels

pytestmark = pytest.mark.skipif(
    not copy_digest.NARROW_FLAGS <= this_cpu().flags, reason="this CPU has no PCLMULQDQ"
)
FORMS = [False] + ([True] if copy_digest.WIDE_FLAGS <= this_cpu().flags else [])
SPAN_BYTES = 576 * 4096 * 2  # a LLaVA-1.5 image span in bf16: 4.72 MB
# Around the 16-byte block, the 64-byte piece, the groups of 8 and 32 blocks, and a long run.
LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 511, 512, 513, 4095, 1 << 20, SPAN_BYTES]


def fused(kernels: Kernels, is_wide: bool) -> copy_digest.FusedCopyDigest:
    return copy_digest.FusedCopyDigest(kernels, is_wide)


def random_bytes(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)  # [num_bytes]


@pytest.mark.parametrize("is_wide", FORMS, ids=lambda wide: "wide" if wide else "narrow")
@pytest.mark.parametrize("num_bytes", LENGTHS)
def test_tag_is_keyed_digest_and_copy_is_source(kernels: Kernels, is_wide: bool, num_bytes: int) -> None:
    source = random_bytes(num_bytes, seed=num_bytes)
    key = os.urandom(shm_digest.KEY_BYTES)
    out = np.empty(num_bytes, dtype=np.uint8)
    tag = fused(kernels, is_wide)(source, out, key)
    assert tag == shm_digest.keyed_digest(source, key)
    assert np.array_equal(out, source)


@pytest.mark.parametrize("is_wide", FORMS, ids=lambda wide: "wide" if wide else "narrow")
@pytest.mark.parametrize(("source_at", "out_at"), [(1, 0), (0, 3), (7, 13), (33, 63)])
def test_odd_offsets_of_source_and_copy(kernels: Kernels, is_wide: bool, source_at: int, out_at: int) -> None:
    for num_bytes in (17, 1000, 70_001):
        whole = random_bytes(num_bytes + source_at, seed=num_bytes + source_at)
        source = whole[source_at:]  # [num_bytes] not aligned to anything
        out_whole = np.zeros(num_bytes + out_at + 5, dtype=np.uint8)
        out = out_whole[out_at : out_at + num_bytes]
        key = os.urandom(shm_digest.KEY_BYTES)
        assert fused(kernels, is_wide)(source, out, key) == shm_digest.keyed_digest(source, key)
        assert np.array_equal(out, source)
        # Nothing written around the copy.
        assert not out_whole[:out_at].any() and not out_whole[out_at + num_bytes :].any()


@pytest.mark.parametrize("is_wide", FORMS, ids=lambda wide: "wide" if wide else "narrow")
def test_random_keys_and_lengths_match_keyed_digest(kernels: Kernels, is_wide: bool) -> None:
    rng = random.Random(52)
    for _ in range(200):
        num_bytes = rng.randrange(0, 3000)
        source = random_bytes(num_bytes, seed=rng.randrange(1 << 30))
        key = rng.randbytes(shm_digest.KEY_BYTES)
        assert fused(kernels, is_wide)(source, np.empty_like(source), key) == shm_digest.keyed_digest(
            source, key
        ), num_bytes


@pytest.mark.parametrize("is_wide", FORMS, ids=lambda wide: "wide" if wide else "narrow")
def test_one_bit_changed_anywhere_changes_the_tag(kernels: Kernels, is_wide: bool) -> None:
    num_bytes = 2 * 512 + 16 * 3 + 5  # two wide groups, whole blocks after them, a partial block
    source = random_bytes(num_bytes, seed=1)
    key = os.urandom(shm_digest.KEY_BYTES)
    read = fused(kernels, is_wide)
    tag = read(source, np.empty_like(source), key)
    rng = random.Random(7)
    for position in range(num_bytes):
        altered = source.copy()
        altered[position] ^= 1 << rng.randrange(8)
        altered_tag = read(altered, np.empty_like(altered), key)
        assert altered_tag != tag, position
        assert altered_tag == shm_digest.keyed_digest(altered, key), position
    longer = np.concatenate([source, np.zeros(1, dtype=np.uint8)])
    assert read(longer, np.empty_like(longer), key) != tag  # the length counts, zeros too


def test_both_forms_agree_on_a_span(kernels: Kernels) -> None:
    source = random_bytes(SPAN_BYTES + 3, seed=3)[3:]
    key = os.urandom(shm_digest.KEY_BYTES)
    tags = {fused(kernels, is_wide)(source, np.empty_like(source), key) for is_wide in FORMS}
    assert tags == {shm_digest.keyed_digest(source, key)}


def test_bad_buffers_and_keys_are_refused_by_name(kernels: Kernels) -> None:
    read = fused(kernels, False)
    source = random_bytes(64, seed=0)
    with pytest.raises(ValueError, match="key must be 32 bytes, got 16"):
        read(source, np.empty_like(source), bytes(16))
    with pytest.raises(ValueError, match="out must hold the source's 64 bytes, got 63"):
        read(source, np.empty(63, dtype=np.uint8), bytes(32))
    with pytest.raises(ValueError, match="source must be a contiguous 1-D uint8 array"):
        read(source.view(np.uint16), np.empty(32, dtype=np.uint16), bytes(32))
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8 array"):
        read(source, np.empty(128, dtype=np.uint8)[::2], bytes(32))
    read_only = np.empty_like(source)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        read(source, read_only, bytes(32))


def test_the_entry_point_refuses_a_negative_length(kernels: Kernels) -> None:
    tag = bytes(16)
    assert kernels.copy_ghash(None, None, -1, bytes(16), bytes(16), tag, 0) == -1


def cpu_with(flags: frozenset[str]) -> CpuInfo:
    return CpuInfo("x86_64", "test CPU", flags)


def test_a_cpu_without_pclmulqdq_keeps_the_two_pass_read(kernels: Kernels) -> None:
    without = cpu_with(this_cpu().flags - {"pclmulqdq"})
    assert copy_digest.for_cpu(without, kernels) is shm_digest.copy_then_digest


def test_the_wide_form_needs_vpclmulqdq(kernels: Kernels) -> None:
    narrow = copy_digest.for_cpu(cpu_with(copy_digest.NARROW_FLAGS), kernels)
    assert isinstance(narrow, copy_digest.FusedCopyDigest) and not narrow.is_wide
    wide = copy_digest.for_cpu(cpu_with(copy_digest.WIDE_FLAGS), kernels)
    assert isinstance(wide, copy_digest.FusedCopyDigest) and wide.is_wide
    source = random_bytes(1000, seed=5)
    key = os.urandom(shm_digest.KEY_BYTES)
    assert narrow(source, np.empty_like(source), key) == shm_digest.keyed_digest(source, key)


def test_without_the_kernels_the_two_pass_read_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_digest, "load_for_cpu", lambda: None)
    assert copy_digest.for_cpu(cpu_with(copy_digest.WIDE_FLAGS)) is shm_digest.copy_then_digest


def test_a_segment_read_with_the_fused_kernel_is_checked_as_before(kernels: Kernels, tmp_path: Path) -> None:
    """decode_shared on a reader that copies and digests in one pass: the rows of an intact segment,
    and a changed byte or another key refused by its digest."""
    maps = shm_segment_maps.SegmentMaps(tmp_path, copy_digest=fused(kernels, FORMS[-1]))
    rows = torch.randn(37, 11).to(torch.bfloat16)  # 814 bytes: groups, blocks and a partial block
    segment = shm_pool.PooledSegment.create(tmp_path, tensors.shared_num_bytes(rows, None) + 3)
    key = os.urandom(shm_digest.KEY_BYTES)
    for change in (None, "byte", "key"):
        name = shared_memory.new_name(shared_memory.SEGMENT_PREFIX)
        segment.link(name)
        handle = tensors.encode_shared(rows, segment.mapping, name, key, 5.0)
        if change == "byte":
            segment.mapping[513] ^= 0x10
        with maps.open(name) as opened:
            read_key = os.urandom(len(key)) if change == "key" else key
            if change is None:
                assert torch.equal(tensors.decode_shared(handle, opened, read_key, "rows", rank=2), rows)
            else:
                with pytest.raises(InvalidArgument, match=r"rows\.digest: does not match"):
                    tensors.decode_shared(handle, opened, read_key, "rows", rank=2)
        shared_memory.remove(tmp_path, name)
    maps.close()
    segment.close()
