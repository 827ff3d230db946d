"""A segment of the writer's pool (`shared_memory.py`'s protocol): created once, its pages allocated and
kept mapped for writing, lent to a call under the call's name."""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

from tandem.common.torch_part.shared_memory import (
    MAP_POPULATE,
    POOL_PREFIX,
    SEGMENT_PREFIX,
    is_name,
    new_name,
    remove,
)
from tandem.common.torch_part.shm_locks import CREATE_TRIES, lock_own, remove_own


class PooledSegment:
    """A segment of a writer's pool, `tandem-pool-<32 hex>`: its pages allocated when it is created and
    mapped for writing until `close`, so writes into it never fault (and a full /dev/shm is an OSError
    at creation rather than a SIGBUS on a write). Its file is locked (flock) while this process holds
    it: a writer that starts later tells a live pool's segments, and the call names linked to them,
    from those of one that died (`remove_abandoned`). A reader reaches it only by a call's name linked
    to it."""

    def __init__(self, directory: Path, name: str, fd: int, mapping: mmap.mmap, num_bytes: int) -> None:
        self.directory = directory
        self.name = name  # "tandem-pool-<32 hex>"
        self.fd = fd  # kept open: it holds the lock
        self.mapping = mapping  # [num_bytes] writable
        self.num_bytes = num_bytes

    @classmethod
    def create(cls, directory: Path, num_bytes: int) -> PooledSegment:
        """A new segment of `num_bytes` (>= 1). Raises OSError and removes what it made on failure."""
        assert num_bytes >= 1
        for _ in range(CREATE_TRIES):
            name = new_name(POOL_PREFIX)
            fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                if not lock_own(directory, name, fd, fcntl.LOCK_EX):
                    os.close(fd)  # another writer starting swept it in the instant before its lock
                    continue
                os.posix_fallocate(fd, 0, num_bytes)
                mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | MAP_POPULATE)
            except BaseException:
                remove_own(directory, name, fd)
                os.close(fd)
                raise
            return cls(directory, name, fd, mapping, num_bytes)
        raise OSError(f"no pool segment in {directory}: each new file was swept before it was locked")

    def link(self, name: str) -> None:
        """Gives the segment a call's `name` as well. Raises OSError (FileExistsError for a name already
        there: nothing is ever written over)."""
        assert is_name(name, SEGMENT_PREFIX)
        os.link(self.directory / self.name, self.directory / name, follow_symlinks=False)

    def close(self) -> None:
        """Unmaps and removes the segment (its pages go once no reader holds them) and unlocks it."""
        self.mapping.close()
        remove(self.directory, self.name)
        os.close(self.fd)
