"""The KV pool's allocation failing: the model knows the bytes it asked for, the engine knows which
flag sized them (--kv-cache-bytes, or --num-kv-blocks), so the error carries the first to the second.

A pool larger than the host's memory (or its overcommit limit, or a cgroup's) failed at start as a bare
`OSError: [Errno 12] Cannot allocate memory` from the mmap in `huge_pages.zeros`, naming no flag
and no size; a device's, as torch's RuntimeError (OutOfMemoryError)."""

from __future__ import annotations

import errno

from tandem.common.memory_limit import MemoryLimit, memory_limit


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


def check_host_memory(num_blocks: int, num_bytes: int, rank: int | None = None) -> None:
    """Refuses a host pool larger than the memory this process may take, before it is mapped.

    The pool is mapped lazily (common/torch_part/huge_pages.py), so where the kernel overcommits
    (vm.overcommit_memory 1, or swap) a pool far past the memory maps, and the start-up went on to
    build the scheduler's table of every block (~170 bytes of Python objects each) for a pool no step
    could ever hold; the first steps to touch it then met the OOM killer. The memory is the host's, or
    its cgroup's limit where smaller (memory_limit.py), swap not counted; each rank checks its own
    pool alone, so ranks sharing a host may together still ask for more than it has. A pool that fits
    may still not fit beside the weights: that one is the allocator's, or the kernel's, to refuse.
    `rank`: the rank whose pool it is, which the refusal names (rank 0 says it for the group); None
    in a decoder of one rank."""
    limit = memory_limit()
    if limit is not None and num_bytes > limit.num_bytes:
        raise KvPoolUnallocated(num_blocks, num_bytes, _more_than(limit, rank))


def _more_than(limit: MemoryLimit, rank: int | None) -> str:
    """The refusal's cause: the limit, and whose it is."""
    if limit.cgroup_file is None:
        host = "this host" if rank is None else f"rank {rank}'s host"
        return f"more than the {limit.num_bytes:,} bytes of memory of {host}"
    cgroup = "this process's cgroup" if rank is None else f"rank {rank}'s cgroup"
    return f"more than the {limit.num_bytes:,} bytes {cgroup} may hold ({limit.cgroup_file})"


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
