"""Paths beneath a directory held open, walked one component at a time by descriptor.

NOTE: the kernel never follows a symlink here. Each component is opened relative to its parent's
descriptor with O_NOFOLLOW (what openat2's RESOLVE_BENEATH does, in calls every POSIX system has), so a
directory swapped for a symlink leading out while a path is walked, or between a walk and a later one,
is refused, never followed: a walk that passed a directory holds its descriptor, whatever its name
leads to since. A symlink inside is resolved by `resolve` itself: its target is walked again from the
directory it lies in (or from the top, for an absolute target naming the top), and a `..` leaves the
directory the walk came through, never one above the top. What `resolve` returns holds no symlink, so
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

# Linux's MAXSYMLINKS: more symlinks in one walk is a loop (ELOOP).
MAX_SYMLINKS = 40
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
    ENOTDIR, ELOOP, EACCES...)."""
    names = list(reversed(path.parts))  # a stack: the next component last
    parts: list[str] = []  # the walk so far, below the top
    fds = [top]  # each directory of `parts` open, the top first (not ours to close)
    num_symlinks = 0
    status = os.fstat(top)
    try:
        while names:
            name = names.pop()
            if name in ("", "."):
                continue
            if name == "..":  # the directory the walk came through: kept open, it cannot lead above
                if not parts:
                    raise LeadsOut
                parts.pop()
                os.close(fds.pop())
                status = os.fstat(fds[-1])
                continue
            status = os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
            if stat.S_ISLNK(status.st_mode):
                num_symlinks += 1
                if num_symlinks > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                target = PurePosixPath(os.readlink(name, dir_fd=fds[-1]))
                if target.is_absolute():
                    relative = below_top(target)
                    if relative is None:
                        raise LeadsOut
                    target = relative
                    for fd in fds[1:]:  # walked again from the top
                        os.close(fd)
                    del parts[:], fds[1:]
                names.extend(reversed(target.parts))
                continue
            if names:  # a directory the walk goes on through
                fds.append(os.open(name, _DIRECTORY_FLAGS, dir_fd=fds[-1]))
            parts.append(name)
        return Resolved(parts=tuple(parts), status=status)
    finally:
        for fd in fds[1:]:
            os.close(fd)


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
