"""The locks on shared-memory files (`shared_memory.py`'s protocol), and the sweep of the files that no
live process holds locked.

NOTE: files left by a process that was killed (SIGKILL, the OOM killer, a test's timeout) would hold a
tmpfs inode and its pages until the host restarts, so every file is locked (flock) by the process that
made it for as long as it lives: the reader's probe shared (LOCK_SH, its fd kept open), the writer's pool
segments exclusively, and a segment's call name is a second name for a locked pool file. A new `Probe`
removes the probe files, and a new pool the pool segments and call names, that no live process holds
locked (`remove_abandoned`: LOCK_EX | LOCK_NB succeeds), only names `is_name` accepts, only regular files
of this user, opened without following a link; a probe younger than PROBE_GRACE_S is left alone. A creator
that finds its file gone once it holds the lock (swept in the instant between its creation and its lock)
makes another under a new name, and an encoder checking a probe being swept finds no file, or one no live
decoder offers: either way bytes, as any doubt. A forked child shares its parent's locks (one open file
description): a probe lives while either process does, and only its creator's `close` removes it.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from tandem.common.torch_part.shared_memory import POOL_PREFIX, SEGMENT_PREFIX, is_name

CREATE_TRIES = 3  # names tried by a creator whose new file a concurrent sweep removed before its lock


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


def lock_own(directory: Path, name: str, fd: int, operation: int) -> bool:
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


def remove_own(directory: Path, name: str, fd: int) -> None:
    """Removes `name` if it is still the file open as `fd`."""
    try:
        if _same_file(os.stat(directory / name, follow_symlinks=False), os.fstat(fd)):
            os.unlink(directory / name)
    except OSError:
        pass
