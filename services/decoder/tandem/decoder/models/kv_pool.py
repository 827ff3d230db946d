"""The KV pool's allocation failing: the model knows the bytes it asked for, the engine knows which
flag sized them (--kv-cache-bytes, or --num-kv-blocks), so the error carries the first to the second.

A pool larger than the host's memory (or its overcommit limit, or a cgroup's) failed at start as a bare
`OSError: [Errno 12] Cannot allocate memory` from the mmap in `huge_pages.zeros`, naming no flag
and no size; a device's, as torch's RuntimeError (OutOfMemoryError)."""

from __future__ import annotations

import errno


class KvPoolUnallocated(MemoryError):
    """The KV pool of `num_blocks` blocks, `num_bytes` in all on this rank, could not be allocated."""

    def __init__(self, num_blocks: int, num_bytes: int, cause: BaseException) -> None:
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.cause = cause
        super().__init__(
            f"the KV pool of {num_blocks:,} blocks ({num_bytes:,} bytes) could not be allocated: {cause}"
        )


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
