"""Paths beneath a directory held open, walked one component at a time by descriptor.

NOTE: the kernel never follows a symlink here. Each component is opened relative to its parent's
descriptor with O_NOFOLLOW (what openat2's RESOLVE_BENEATH does, in calls every POSIX system has), so a
directory swapped for a symlink leading out while a path is walked, or between a walk and a later one,
is refused, never followed: a walk that passed a directory holds its descriptor, whatever its name
leads to since. A symlink inside is resolved by `resolve` itself: its target is walked again from the
directory it lies in (or from the top, for an absolute target naming the top), and a `..` returns to
the directory the walk came through (by identity: one moved out of the top since is refused), never one
above the top. A walk holds two descriptors at most and is bounded in bytes and in steps (MAX_PATH_BYTES,
MAX_SYMLINKS, MAX_COMPONENTS), whatever the tree or its symlinks. What `resolve` returns holds no symlink, so
`open_beneath` takes it with no symlink followed at all: one there now was swapped in since.
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# Linux's PATH_MAX: no longer path names a file, and what a resolved path below the top may hold.
MAX_PATH_BYTES = 4096
# Linux's MAXSYMLINKS: more symlinks in one walk is a loop (ELOOP).
MAX_SYMLINKS = 40
# The components one walk may take, symlink targets and '..' included. Each costs a few system calls,
# and without a bound a short path costs ~80,000 of them: 40 symlinks each naming a target of ~2,000
# components (a 4,096-byte target, "a/a/...") walks 41 x 2,000 (~0.5 s a walk, and a load walks up to
# 3 times). Every component costs a path or a target at least 2 bytes ("a/"), so the longest path that
# can result, MAX_PATH_BYTES, takes 2,048: twice that lets a walk re-walk such a path once more by a
# symlink (or climb it back by '..'), which no adapter directory needs, and refuses a crafted chain in
# ~4,096 steps (ELOOP, as too many symlinks is).
MAX_COMPONENTS = MAX_PATH_BYTES
# O_NONBLOCK: a FIFO swapped in is refused (ENOTDIR), never waited on for a writer.
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class OpenDirectory:
    """A directory held open by descriptor for as long as this object lives (its descriptor is closed
    when it is collected): whatever its path names later, `fd` is the directory it named when opened."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)


@dataclass(frozen=True)
class Resolved:
    """Where a walk beneath a directory ended."""

    parts: tuple[str, ...]  # the path below the top, no symlink on it
    status: os.stat_result  # what stood at its last component (never a symlink) when walked


class LeadsOut(Exception):
    """The path, or a symlink on it, leads above the top of the walk (or is absolute, elsewhere)."""


def resolve(
    top: int, path: PurePosixPath, below_top: Callable[[PurePosixPath], PurePosixPath | None]
) -> Resolved:
    """Relative path `path` beneath the directory open as `top`, every symlink on it resolved by walking
    its target beneath `top` too: the components, none a symlink, that led to what is there (a directory
    or a file), and its status. `below_top` maps an absolute symlink target to its path below the top,
    or None where it lies elsewhere. Raises LeadsOut, or OSError where it leads nowhere (ENOENT,
    ENOTDIR, EACCES...), past MAX_PATH_BYTES (ENAMETOOLONG) or past MAX_SYMLINKS or MAX_COMPONENTS
    (ELOOP).

    Two descriptors at most are open at once, the top's aside, however deep the walk: one a level
    (what a '..' climbs back through) let one walk of a deep tree hold thousands, and every other open
    in the process fail with EMFILE meanwhile. Each directory entered is kept by its identity instead,
    and a '..' opens the parent of the directory the walk is in, which must be the one it came through
    (a directory moved since, out of the top, leads out: refused), or is the top itself, held."""
    names = list(reversed(path.parts))  # a stack: the next component last
    parts: list[str] = []  # the walk so far, below the top
    identities: list[tuple[int, int]] = []  # each directory of `parts` as entered: (st_dev, st_ino)
    num_bytes = 0  # of "/".join(parts)
    num_symlinks = num_components = 0
    status = os.fstat(top)
    fd = top  # the directory the walk is in: the top (not ours to close) or one of ours
    try:
        while names:
            name = names.pop()
            num_components += 1
            if num_components > MAX_COMPONENTS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            if name in ("", "."):
                continue
            if name == "..":
                if not parts:
                    raise LeadsOut
                num_bytes -= len(os.fsencode(parts.pop())) + 1
                identities.pop()
                fd = _move(fd, top, _parent(fd, identities[-1]) if identities else top)
                status = os.fstat(fd)
                continue
            status = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(status.st_mode):
                num_symlinks += 1
                if num_symlinks > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                target = PurePosixPath(os.readlink(name, dir_fd=fd))
                if target.is_absolute():
                    relative = below_top(target)
                    if relative is None:
                        raise LeadsOut
                    target = relative
                    fd = _move(fd, top, top)  # walked again from the top
                    del parts[:], identities[:]
                    num_bytes = 0
                names.extend(reversed(target.parts))
                continue
            num_bytes += len(os.fsencode(name)) + 1
            if num_bytes - 1 > MAX_PATH_BYTES:
                raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
            if names:  # a directory the walk goes on through
                fd = _move(fd, top, os.open(name, _DIRECTORY_FLAGS, dir_fd=fd))
                entered = os.fstat(fd)
                identities.append((entered.st_dev, entered.st_ino))
            parts.append(name)
        return Resolved(parts=tuple(parts), status=status)
    finally:
        if fd != top:
            os.close(fd)


def _parent(fd: int, identity: tuple[int, int]) -> int:
    """The parent of the directory open as `fd`, opened: the directory of `identity`, or LeadsOut."""
    parent = os.open("..", _DIRECTORY_FLAGS, dir_fd=fd)
    status = os.fstat(parent)
    if (status.st_dev, status.st_ino) != identity:  # moved since: above it lies another directory
        os.close(parent)
        raise LeadsOut
    return parent


def _move(fd: int, top: int, to: int) -> int:
    """`to`, the walk's directory from now on, `fd` (the one it leaves) closed unless it is the top."""
    if fd != top:
        os.close(fd)
    return to


def open_beneath(top: int, parts: tuple[str, ...], flags: int) -> int:
    """A descriptor for `parts` (as resolve gives them) beneath the directory open as `top`, opened with
    `flags`, no component followed if it is a symlink. Raises OSError: ELOOP/ENOTDIR/EMLINK where a
    symlink (or a file) now stands for a directory or the last component, ENOENT where nothing does."""
    if not parts:
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
    fd = top
    try:
        for name in parts[:-1]:
            parent, fd = fd, os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
            if parent != top:
                os.close(parent)
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        if fd != top:
            os.close(fd)
