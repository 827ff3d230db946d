"""The KV pool's allocation refused: only the allocation's own refusals become KvPoolUnallocated (the
start error naming --kv-cache-bytes); any other error while allocating stays what it is."""

from __future__ import annotations

import errno

import pytest
import torch

from tandem.decoder.models.kv_pool import out_of_memory


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
