"""The KV pool's allocation failing: the model knows the bytes it asked for, the engine knows which
flag sized them (--kv-cache-bytes, or --num-kv-blocks), so the error carries the first to the second.

A pool larger than the host's memory (or its overcommit limit, or a cgroup's) failed at start as a bare
`OSError: [Errno 12] Cannot allocate memory` from the mmap in `huge_pages.zeros`, naming no flag
and no size; a device's, as torch's RuntimeError (OutOfMemoryError)."""

from __future__ import annotations


class KvPoolUnallocated(MemoryError):
    """The KV pool of `num_blocks` blocks, `num_bytes` in all on this rank, could not be allocated."""

    def __init__(self, num_blocks: int, num_bytes: int, cause: BaseException) -> None:
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.cause = cause
        super().__init__(
            f"the KV pool of {num_blocks:,} blocks ({num_bytes:,} bytes) could not be allocated: {cause}"
        )
