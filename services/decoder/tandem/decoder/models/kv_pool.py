"""The KV pool's allocation failing: the model knows the bytes it asked for, the engine knows which
flag sized them (--kv-cache-bytes, or --num-kv-blocks), so the error carries the first to the second.

A pool larger than the host's memory (or its overcommit limit, or a cgroup's) failed at start as a bare
`OSError: [Errno 12] Cannot allocate memory` from the mmap in `huge_pages.zeros`, naming no flag
and no size; a device's, as torch's RuntimeError (OutOfMemoryError)."""

from __future__ import annotations

import errno
import os


class KvPoolUnallocated(MemoryError):
    """The KV pool of `num_blocks` blocks, `num_bytes` in all on one rank, could not be allocated.

    `cause` is what refused it, in its own words (the allocator's error, or the host's memory); `rank`
    the rank whose pool it was, None in a decoder of one rank."""

    def __init__(self, num_blocks: int, num_bytes: int, cause: str, rank: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.cause = cause
        self.rank = rank
        super().__init__(
            f"the KV pool of {num_blocks:,} blocks ({num_bytes:,} bytes) could not be allocated: {cause}"
        )


def check_host_memory(num_blocks: int, num_bytes: int) -> None:
    """Refuses a host pool larger than the host's physical memory, before it is mapped.

    The pool is mapped lazily (common/torch_part/huge_pages.py), so where the kernel overcommits
    (vm.overcommit_memory 1, or swap) a pool far past the memory maps, and the start-up went on to
    build the scheduler's table of every block (~170 bytes of Python objects each) for a pool no step
    could ever hold; the first steps to touch it then met the OOM killer. A pool that fits the
    physical memory may still not fit beside the weights or a cgroup's limit: that one is the
    allocator's, or the kernel's, to refuse."""
    memory = host_memory_bytes()
    if memory is not None and num_bytes > memory:
        raise KvPoolUnallocated(num_blocks, num_bytes, f"more than this host's {memory:,} bytes of memory")


def host_memory_bytes() -> int | None:
    """The host's physical memory in bytes; None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None


# torch's CPU allocator says so in a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory: you
# tried to allocate N bytes"); a device's allocator raises OutOfMemoryError ("... out of memory ...").
_ALLOCATOR_REFUSALS = ("can't allocate memory", "out of memory")


def out_of_memory(error: BaseException) -> bool:
    """Whether `error`, raised while the pool was allocated, is the allocation refused for its size
    (ENOMEM, a size mmap cannot map, an allocator's refusal), not a fault of something else."""
    if isinstance(error, (MemoryError, OverflowError)):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _ALLOCATOR_REFUSALS)
