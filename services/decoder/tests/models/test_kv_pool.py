"""The KV pool's allocation refused: only the allocation's own refusals become KvPoolUnallocated (the
start error naming --kv-cache-bytes); any other error while allocating stays what it is. A host pool
larger than the memory the process may take (memory_limit.py) is refused before it is mapped: mapped
lazily, it would map where the kernel overcommits, and no step could ever hold it."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from tandem.common.memory_limit import MemoryLimit
from tandem.common.torch_part import huge_pages
from tandem.decoder.models import kv_pool
from tandem.decoder.models.kv_pool import KvPoolUnallocated, check_host_memory, out_of_memory
from tandem.decoder.models.loader import LoadedModel


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOMEM, "Cannot allocate memory"),  # mmap's, in huge_pages.zeros
        OverflowError("Python int too large to convert to C ssize_t"),  # mmap of --kv-cache-bytes 1e20
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ],
    ids=["enomem", "overflow", "memory-error", "device-oom"],
)
def test_the_allocations_own_refusals_are_out_of_memory(error: BaseException) -> None:
    assert out_of_memory(error)


def test_torchs_cpu_allocator_refusal_is_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**62, dtype=torch.uint8)  # "DefaultCPUAllocator: can't allocate memory: ..."
    assert out_of_memory(refused.value)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),  # left by an earlier kernel
        OSError(errno.EACCES, "Permission denied"),
    ],
    ids=["device-fault", "eacces"],
)
def test_other_errors_while_allocating_are_not(error: BaseException) -> None:
    assert not out_of_memory(error)


def test_a_pool_as_large_as_the_memory_limit_passes_and_a_byte_more_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(1 << 30, None))
    check_host_memory(4, 1 << 30)
    with pytest.raises(KvPoolUnallocated) as refused:
        check_host_memory(4, (1 << 30) + 1)
    assert (refused.value.num_blocks, refused.value.num_bytes, refused.value.rank) == (4, (1 << 30) + 1, None)
    assert refused.value.cause == "more than the 1,073,741,824 bytes of memory of this host"


def test_a_ranks_refusal_names_that_ranks_host_or_cgroup_not_this_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 says the refusal for the group: 'this host' there would be its own, not rank 1's."""
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(1 << 20, None))
    with pytest.raises(
        KvPoolUnallocated, match=r"^.*: more than the 1,048,576 bytes of memory of rank 1's host$"
    ):
        check_host_memory(4, 1 << 21, rank=1)
    cgroup = MemoryLimit(1 << 20, Path("/sys/fs/cgroup/memory.max"))
    monkeypatch.setattr(kv_pool, "memory_limit", lambda: cgroup)
    with pytest.raises(KvPoolUnallocated) as refused:
        check_host_memory(4, 1 << 21, rank=1)
    assert (
        refused.value.cause
        == "more than the 1,048,576 bytes rank 1's cgroup may hold (/sys/fs/cgroup/memory.max)"
    )
    with pytest.raises(KvPoolUnallocated) as refused:
        check_host_memory(4, 1 << 21)
    assert refused.value.cause == (
        "more than the 1,048,576 bytes this process's cgroup may hold (/sys/fs/cgroup/memory.max)"
    )


def test_a_host_pool_past_the_memory_limit_is_refused_before_anything_is_mapped(
    tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_: object) -> torch.Tensor:
        raise AssertionError("mapped")

    monkeypatch.setattr(kv_pool, "memory_limit", lambda: MemoryLimit(1 << 20, None))
    monkeypatch.setattr(huge_pages, "zeros", never)
    with pytest.raises(KvPoolUnallocated) as refused:
        tiny_fp32.model.allocate_kv_cache(1 << 20, 16)
    assert refused.value.num_blocks == 1 << 20
    assert refused.value.cause == "more than the 1,048,576 bytes of memory of this host"
