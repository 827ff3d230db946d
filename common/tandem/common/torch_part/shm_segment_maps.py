"""The reader's side of a shared-memory segment (`shared_memory.py`'s protocol): a segment opened by a
call's name, read through the reader's mapping of its file, and the mappings it keeps for the next
call given the same pool segment."""

from __future__ import annotations

import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.common.torch_part.shared_memory import MAP_POPULATE, SEGMENT_PREFIX, is_name
from tandem.common.torch_part.shm_digest import CopyDigest, copy_then_digest

MAX_MAPS = 64  # a reader's mappings kept (`SegmentMaps`): each holds its file open
MAX_MAPPED_BYTES = 1 << 31  # and their bytes, the pool's own pages: address space, no more memory
SWEEP_S = 1.0  # how often a reader drops the mappings of files given back


@dataclass(eq=False)
class _Mapping:
    """The reader's read-only mapping of one segment's file."""

    file: tuple[int, int]  # (st_dev, st_ino): the file, whatever its names
    fd: int  # kept open while mapped: the inode (and its number) cannot be reused meanwhile
    mapping: mmap.mmap  # [num_bytes] read-only
    num_bytes: int
    users: int = 0  # Segments open on it: it is unmapped only once none is
    kept: bool = False  # in the reader's SegmentMaps, for the next call given the same file
    last_used: float = 0.0


class Segment:
    """A segment opened for reading by the name a call asked for, read through the reader's mapping of
    its file. Its bytes are copied into the reader's own memory, never used in place: a pool's segment
    is written again once its reader released it. `close` (or `with`) once read."""

    def __init__(self, maps: SegmentMaps, mapped: _Mapping) -> None:
        self._maps = maps
        self._mapped: _Mapping | None = mapped
        self.num_bytes = mapped.num_bytes  # the file's size when opened

    def read_into(self, offset: int, out: memoryview | bytearray | np.ndarray) -> bool:
        """Fills `out` with the bytes at `offset`; False (and `out` untouched) when the segment holds
        fewer."""
        assert self._mapped is not None, "read after close"
        target = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]
        if offset < 0 or offset + len(target) > self.num_bytes:
            return False
        # numpy's copy on this thread, the GIL released: one pass, no page faults (the pages are mapped).
        np.copyto(target, np.frombuffer(self._mapped.mapping, np.uint8, count=len(target), offset=offset))
        return True

    def read_digested(self, offset: int, out: np.ndarray, key: bytes) -> bytes | None:
        """Fills `out` ([n] uint8) with the bytes at `offset` and returns their keyed digest, by the
        reader's CopyDigest; None (and `out` untouched) when the segment holds fewer."""
        assert self._mapped is not None, "read after close"
        if offset < 0 or offset + len(out) > self.num_bytes:
            return None
        source = np.frombuffer(self._mapped.mapping, np.uint8, count=len(out), offset=offset)  # [n]
        return self._maps.copy_digest(source, out, key)

    def close(self) -> None:
        if self._mapped is not None:
            self._maps._release(self._mapped)
            self._mapped = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SegmentMaps:
    """The reader's mappings of the segments it was given, kept so that a pool's segment given to it
    again (under a new call's name: one file, two names) is read without mapping it again.

    NOTE: a segment is still reached only by a call's own name: `open` opens that name, checks the file
    (a regular file of this user, not a symbolic link) and only then looks the file up by its device and
    inode among the mappings kept (each holds its file open, so no other file can take that inode's
    number meanwhile). Mapping a pool segment's file costs its page tables once (MAP_POPULATE), where
    `preadv` paid the kernel's page lookups on every read. A mapping is dropped once its file has no
    name left (the writer gave its segment back, or a reader removed the last name of a file that was
    never pooled), checked at every `open` and every SWEEP_S on a thread of its own, so the reader
    never holds pages the writer freed for longer; and it is bounded: at most `max_maps` files and
    `max_bytes`, the least recently used dropped first, and past them (every mapping being read) a
    file is mapped for the one read. A file shrunk under a mapping would stop the reader (SIGBUS):
    the writer never shrinks its segments, and only the user both run as could."""

    def __init__(
        self,
        directory: Path,
        max_maps: int = MAX_MAPS,
        max_bytes: int = MAX_MAPPED_BYTES,
        sweep_s: float = SWEEP_S,
        copy_digest: CopyDigest | None = None,  # None: copy_then_digest
    ) -> None:
        self.directory = directory
        self.copy_digest = copy_digest or copy_then_digest
        self.max_maps = max_maps
        self.max_bytes = max_bytes
        self.sweep_s = sweep_s
        self._kept: dict[tuple[int, int], _Mapping] = {}
        self._lock = threading.Lock()  # opened on reading threads, swept on one of its own
        self.num_mapped = 0  # files mapped (tests, the benchmark): what keeping saves is reads - this
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_until_stopped, name="segment-maps", daemon=True)
        self._sweeper.start()

    def open(self, name: str) -> Segment | None:
        """The segment `name` opened for reading, or None when it is gone. Raises PermissionError for a
        file that is not a regular file of this process's user (or empty), OSError when it cannot be
        opened or mapped."""
        assert is_name(name, SEGMENT_PREFIX)
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size == 0:
                raise PermissionError(f"{name} is not a segment of this user")
            file = (info.st_dev, info.st_ino)
            with self._lock:
                self._sweep()
                kept = self._kept.get(file)
                if kept is not None and kept.num_bytes == info.st_size:
                    kept.users += 1
                    kept.last_used = time.monotonic()
                    os.close(fd)
                    return Segment(self, kept)
                if kept is not None:  # the same file, another size: never the pool's, mapped anew
                    self._forget(kept)
            mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | MAP_POPULATE, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        mapped = _Mapping(file, fd, mapping, info.st_size, users=1, last_used=time.monotonic())
        with self._lock:
            self.num_mapped += 1
            if file not in self._kept and self._make_room(mapped.num_bytes):
                mapped.kept = True
                self._kept[file] = mapped
        return Segment(self, mapped)

    @property
    def num_kept(self) -> int:
        """Files mapped and kept now."""
        with self._lock:
            self._sweep()
            return len(self._kept)

    def close(self) -> None:
        """Stops the sweeper and unmaps every file (those being read once their read ends)."""
        self._stop.set()
        self._sweeper.join()
        with self._lock:
            for mapped in list(self._kept.values()):
                self._forget(mapped)

    def _release(self, mapped: _Mapping) -> None:
        with self._lock:
            mapped.users -= 1
            if not mapped.kept and mapped.users == 0:
                _unmap(mapped)

    def _make_room(self, num_bytes: int) -> bool:
        """Under the lock: drops the least recently used mappings not being read until one of
        `num_bytes` fits; False when it cannot."""
        if num_bytes > self.max_bytes:
            return False
        idle = sorted((m for m in self._kept.values() if m.users == 0), key=lambda m: m.last_used)
        while len(self._kept) >= self.max_maps or self._num_bytes() + num_bytes > self.max_bytes:
            if not idle:
                return False
            self._forget(idle.pop(0))
        return True

    def _num_bytes(self) -> int:
        return sum(mapped.num_bytes for mapped in self._kept.values())

    def _forget(self, mapped: _Mapping) -> None:
        """Under the lock: no longer kept; unmapped now, or by its last reader."""
        del self._kept[mapped.file]
        mapped.kept = False
        if mapped.users == 0:
            _unmap(mapped)

    def _sweep(self) -> None:
        """Under the lock: drops the mappings of files that have no name left."""
        for mapped in list(self._kept.values()):
            try:
                gone = os.fstat(mapped.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._forget(mapped)

    def _sweep_until_stopped(self) -> None:
        while not self._stop.wait(self.sweep_s):
            with self._lock:
                self._sweep()


def _unmap(mapped: _Mapping) -> None:
    mapped.mapping.close()
    os.close(mapped.fd)
