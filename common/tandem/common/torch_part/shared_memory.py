"""Shared-memory segments between an encoder and a decoder on one host: names, the proof of sharing a
host, creating and opening segments, and the keyed digest of their bytes. Files and bytes only: rows
become tensors in `tensors.py`.

NOTE: the protocol. The decoder (the reader) creates a probe file in its /dev/shm, `tandem-probe-<32
hex>`, mode 0600, holding 32 random bytes, and sends its name and content with every Embed call, with
a fresh segment name `tandem-rows-<32 hex>` and a fresh 32-byte digest key (`SharedMemoryOffer`). The
encoder (the writer) takes the offer only if the file of that name in its own /dev/shm is a regular
file of its own user holding exactly those bytes: both then see one /dev/shm (one host, one IPC
namespace) as one user. It keeps a pool of segments, `tandem-pool-<32 hex>`, created once, their pages
allocated and kept mapped (a fresh tmpfs page costs 20-40 times its copy: docs/PERFORMANCE.md); for a
call it links a free one under the name asked for (a second name for the same file, O_EXCL-like:
never over a file already there), writes the rows (its embedder straight into the mapping where it
can, else a copy), and replies with a handle (`SharedTensor`) carrying their keyed digest, computed
over the segment as written: nothing else writes a leased segment but the user both run as. The
reader opens only the name it asked for, checks the handle against the file, copies the bytes into
its own memory (through its mapping of the file, kept for the next call given the same pool segment:
`SegmentMaps`) and checks the digest of that copy under its own key (the copy and the digest are one
pass where the reader has a fused `CopyDigest`: the decoder's C kernel), then removes the name: that
releases the segment to the writer's pool, and a handle replayed later finds nothing. One pointing
anywhere else is refused before anything is opened. The writer removes the name of a segment no
reader released after its lease, and only then writes into it again: a reader that comes later still
finds the name gone, and one that outlived the lease while reading sees its digest fail, never other
rows.

Files left by a process that was killed (SIGKILL, the OOM killer, a test's timeout) would hold a tmpfs
inode and its pages until the host restarts, so every file is locked (flock) by the process that made
it for as long as it lives: the reader's probe shared (LOCK_SH, its fd kept open), the writer's pool
segments exclusively, and a segment's call name is a second name for a locked pool file. A new
`Probe` removes the probe files, and a new pool the pool segments and call names, that no live process
holds locked (`remove_abandoned`: LOCK_EX | LOCK_NB succeeds), only names `is_name` accepts, only
regular files of this user, opened without following a link; a probe younger than PROBE_GRACE_S is
left alone. A creator that finds its file gone once it holds the lock (swept in the instant between
its creation and its lock) makes another under a new name, and an encoder checking a probe being
swept finds no file, or one no live decoder offers: either way bytes, as any doubt. A forked child
shares its parent's locks (one open file description): a probe lives while either process does, and
only its creator's `close` removes it.

Who can reach a segment: only the user both services run as (mode 0600 under /dev/shm, a sticky
directory), and only by its name, 128 random bits that travel in the Embed call and its reply. That
user can read or change a segment, as it can read or change either process's memory: the digest
detects a segment changed or swapped after it was written, by a bug or a stale file, and ties the
handle to this call's key, but it is no defence against that user.

The digest is AES-256-GMAC (GCM with nothing to encrypt: its tag over the rows as associated data)
under the call's key, with a fixed nonce: each key is drawn for one call and tags one message, the
rows the writer wrote; the reader recomputes it over its own copy and keeps its result to
itself. Without the key a tag cannot be predicted, and two different byte strings of L 16-byte blocks
share a tag under a random key with probability at most about L / 2^128. It runs from the
`cryptography` wheel's OpenSSL at GHASH speed on carry-less multiplication (PCLMULQDQ, VPCLMULQDQ and
VAES on the Zen 4 machine measured: 23 GB/s, against 12.8 for Poly1305, 7.4 for the numpy universal
hash it replaced, 1.8 for HMAC-SHA256 and 0.9 for keyed BLAKE2b; docs/PERFORMANCE.md). Both sides
read every byte under the call's key: the writer in a pass of its own over the segment; the reader,
where its CPU has PCLMULQDQ, in the same pass as its copy (the decoder's `copy_digest` kernel computes
GHASH in C from the bytes it copies, with H and E_K(J0) from OpenSSL: the same tag bit for bit),
elsewhere in a second pass over its copy (`copy_then_digest`).
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SHM_DIR = Path("/dev/shm")
PROBE_PREFIX = "tandem-probe-"
SEGMENT_PREFIX = "tandem-rows-"  # a call's name for a segment: the reader's choice
POOL_PREFIX = "tandem-pool-"  # the writer's own name for a segment of its pool
TOKEN_BYTES = 32  # a probe file's content
KEY_BYTES = 32  # a digest key
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the page tables filled when mapped
DIGEST_BYTES = 16  # a GCM tag
DIGEST_NONCE = bytes(12)  # fixed: a key tags one message (the note)
DIGEST_UPDATE_BYTES = 1 << 30  # fed to the MAC in parts of at most this: its one call takes < 2^31
MAX_MAPS = 64  # a reader's mappings kept (`SegmentMaps`): each holds its file open
MAX_MAPPED_BYTES = 1 << 31  # and their bytes, the pool's own pages: address space, no more memory
SWEEP_S = 1.0  # how often a reader drops the mappings of files given back
# A probe file this recent is never swept, locked or not: its creator locks it within microseconds of
# creating it, and a stall between the two (a stopped process) must not cost it its probe.
PROBE_GRACE_S = 10.0
CREATE_TRIES = 3  # names tried by a creator whose new file a concurrent sweep removed before its lock
_NAME = re.compile(r"(tandem-probe-|tandem-rows-|tandem-pool-)[0-9a-f]{32}")

# How a reader copies a segment's bytes and digests them: (source [n] uint8 read-only, out [n] uint8,
# key) -> keyed_digest of the bytes written to `out`. `copy_then_digest` is two passes; the decoder
# passes its fused kernel where its CPU has one (tandem.decoder.backends.cpu.copy_digest).
CopyDigest = Callable[[np.ndarray, np.ndarray, bytes], bytes]


def new_name(prefix: str) -> str:
    """A fresh name under `prefix`: 128 random bits, in hex."""
    return prefix + secrets.token_hex(16)


def is_name(name: str, prefix: str) -> bool:
    """`name` is `prefix` and 32 lowercase hex digits: nothing else is ever opened or created."""
    return name.startswith(prefix) and _NAME.fullmatch(name) is not None


def is_supported(directory: Path = SHM_DIR) -> bool:
    """Segments hold little-endian rows as they lie in memory: a little-endian host with the directory."""
    return sys.byteorder == "little" and directory.is_dir()


class Probe:
    """The reader's proof file: created once, locked (shared) while its creator lives, removed by `close`
    (or, once its creator is gone, by the next `create` in that directory)."""

    def __init__(self, directory: Path, name: str, token: bytes, fd: int = -1) -> None:
        self.directory = directory
        self.name = name  # "tandem-probe-<32 hex>"
        self.token = token  # [TOKEN_BYTES] the file's content
        self.fd = fd  # kept open until `close`: it holds the lock; -1: none
        self.pid = os.getpid()  # its creator: a forked child's copy never removes its parent's file

    @classmethod
    def create(cls, directory: Path = SHM_DIR) -> Probe | None:
        """A new probe file, once the probes of readers that died are removed; None where segments
        cannot be shared (no such directory, no room)."""
        if not is_supported(directory):
            return None
        remove_abandoned(directory, (PROBE_PREFIX,), PROBE_GRACE_S)
        for _ in range(CREATE_TRIES):
            name, token = new_name(PROBE_PREFIX), secrets.token_bytes(TOKEN_BYTES)
            try:
                fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except OSError:
                return None
            try:
                if not _lock_own(directory, name, fd, fcntl.LOCK_SH):
                    os.close(fd)  # swept in the instant before its lock: another name
                    continue
                if os.write(fd, token) != TOKEN_BYTES:
                    raise OSError("a short write: no room")
            except BaseException as error:
                _remove_own(directory, name, fd)
                os.close(fd)
                if isinstance(error, OSError):
                    return None
                raise
            return cls(directory, name, token, fd)
        return None

    def close(self) -> None:
        """Removes the file (in the process that created it) and lets go of its lock."""
        if os.getpid() == self.pid:
            remove(self.directory, self.name)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def probe_matches(directory: Path, name: str, token: bytes) -> bool:
    """The writer's check of an offer: `name` is a regular file of this process's user in `directory`
    holding exactly `token`. Any doubt is False: the reply then carries bytes."""
    if not is_name(name, PROBE_PREFIX) or len(token) != TOKEN_BYTES or not is_supported(directory):
        return False
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size != TOKEN_BYTES:
            return False
        content = os.read(fd, TOKEN_BYTES)
    except OSError:
        return False
    finally:
        os.close(fd)
    return hmac.compare_digest(content, token)


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
                if not _lock_own(directory, name, fd, fcntl.LOCK_EX):
                    os.close(fd)  # another writer starting swept it in the instant before its lock
                    continue
                os.posix_fallocate(fd, 0, num_bytes)
                mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
            except BaseException:
                _remove_own(directory, name, fd)
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


def remove_abandoned(
    directory: Path, prefixes: tuple[str, ...] = (POOL_PREFIX, SEGMENT_PREFIX), min_age_s: float = 0.0
) -> int:
    """Removes the files of processes that died (a SIGKILL, an OOM kill): files of this user named
    `<prefix><32 hex>` for one of `prefixes` that no live process holds locked, last modified at least
    `min_age_s` ago; by default a writer's pool segments and the call names linked to them (a live
    writer's are locked through its pool's file). Nothing else is opened, a symbolic link is never
    followed, and any doubt leaves a file where it is. Returns how many it removed."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return 0
    try:
        names = [name for name in os.listdir(dir_fd) if any(is_name(name, prefix) for prefix in prefixes)]
        return sum(_remove_if_abandoned(dir_fd, name, min_age_s) for name in names)
    finally:
        os.close(dir_fd)


def _remove_if_abandoned(dir_fd: int, name: str, min_age_s: float) -> bool:
    try:
        if not _is_own_file(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
            return False  # never opened: a link, a directory, a FIFO, another user's file
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not _is_own_file(info) or time.time() - info.st_mtime < min_age_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its process is alive
        if not _same_file(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), info):
            return False  # the name is another file's by now
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_own_file(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock_own(directory: Path, name: str, fd: int, operation: int) -> bool:
    """Locks the file just created as `name` (fd); False when a sweep removed it before the lock (it
    found it unlocked, and holds or held it exclusively): the caller then tries another name. Once
    locked, no sweep removes it."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        return _same_file(os.stat(directory / name, follow_symlinks=False), os.fstat(fd))
    except FileNotFoundError:
        return False


def _remove_own(directory: Path, name: str, fd: int) -> None:
    """Removes `name` if it is still the file open as `fd`."""
    try:
        if _same_file(os.stat(directory / name, follow_symlinks=False), os.fstat(fd)):
            os.unlink(directory / name)
    except OSError:
        pass


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
            mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
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


def remove(directory: Path, name: str) -> bool:
    """Removes the file `name`; False when it was gone already."""
    try:
        os.unlink(directory / name)
    except FileNotFoundError:
        return False
    return True


def exists(directory: Path, name: str) -> bool:
    return os.path.lexists(directory / name)


def keyed_digest(data: memoryview | bytes | np.ndarray, key: bytes) -> bytes:
    """DIGEST_BYTES of `data` under `key` (KEY_BYTES): AES-256-GMAC, see the module's note."""
    assert len(key) == KEY_BYTES
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    context = Cipher(algorithms.AES(key), modes.GCM(DIGEST_NONCE)).encryptor()
    for start in range(0, len(view), DIGEST_UPDATE_BYTES):
        context.authenticate_additional_data(view[start : start + DIGEST_UPDATE_BYTES])
    context.finalize()
    return context.tag


def copy_then_digest(source: np.ndarray, out: np.ndarray, key: bytes) -> bytes:
    """The CopyDigest of any CPU: numpy's copy, then keyed_digest over the copy (two passes)."""
    np.copyto(out, source)
    return keyed_digest(out, key)
