"""An adapter directory's files, each read whole from one descriptor opened relative to the directory's.

NOTE: how the files are read. The directory is opened once and each file relative to it, without
blocking (a FIFO swapped in after any check would hold the one adapter-reader thread, every later load
and the server's exit for ever: the open is O_NONBLOCK and anything fstat does not call a regular file
is refused; a name that led to no regular file when it was looked up, by find or just before, is refused
unopened, as opening a device acts on it, and the open is O_NOCTTY), and read whole into memory from
that descriptor, never memory-mapped: a mapped file that shrinks under the reader (`cp` over it
truncates, then writes) kills the process with SIGBUS, and every stream on the server with it. The read
is bounded by the file's size at open, and that size by what an adapter of its r for this base model can
hold; a file whose size, mtime or change time moved during the read is refused (`cp -p` sets the mtime
back over a same-size rewrite; no call sets the change time back). A directory AdapterRoot.find resolved
inside --lora-root (`found`) is never opened by its path: the read walks from the root's descriptor, one
component at a time, along the path find resolved (beneath.py: no symlink is followed, so a directory
swapped for one leading out since is refused), and opens each file where its name led then, which must
still be the file find saw, reached by the same entry (a symlink swapped in for the name, or for any
directory on the way, is refused; one that was there, into an HF cache's blobs/, still reads). No
refusal formats an OS or library error that may hold the server's own path: a refusal names the
directory as `shown`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.decoder.models.adapter_error import AdapterError
from tandem.decoder.models.beneath import OpenDirectory, open_beneath

# O_NOCTTY: a terminal device swapped in between the type's check and the open never becomes the
# server's controlling terminal (the open is then refused as another file).
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# What open(2) with O_NOFOLLOW says of a symlink: ENOTDIR (Linux, with O_DIRECTORY), ELOOP (Linux,
# macOS), EMLINK (FreeBSD): a symlink, or a file, stands where a directory or the file was.
_SYMLINK_REFUSED = (errno.ENOTDIR, errno.ELOOP, errno.EMLINK)
# And ENOENT of nothing there. All mean the path names no directory.
NOT_A_DIRECTORY = (errno.ENOENT, *_SYMLINK_REFUSED)
_MAX_READ_BYTES = 1 << 30  # one read(2); Linux returns at most ~2 GiB a call


@dataclass(frozen=True)
class FileIdentity:
    """Which file a name led to when it was checked: the same file wherever it is linked from."""

    device: int  # st_dev
    inode: int  # st_ino

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        return cls(device=status.st_dev, inode=status.st_ino)


@dataclass(frozen=True)
class FoundFile:
    """Where an adapter file's name led inside --lora-root when AdapterRoot.find walked it."""

    # What the name's symlink said (an HF snapshot's, into blobs/); None: the name was the file itself.
    # Not the symlink's inode: one unlinked and made again with another target often gets the same.
    link: str | None
    parts: tuple[str, ...]  # the file's path below the root, no symlink on it (beneath.resolve)
    identity: FileIdentity  # the file there
    # Its stat.S_IFMT: anything but a regular file is refused before it is opened (opening a device
    # may act on it: a tape rewinds, a modem hangs up).
    file_type: int

    @property
    def is_regular(self) -> bool:
        return self.file_type == stat.S_IFREG


@dataclass(frozen=True)
class FoundAdapter:
    """An adapter directory AdapterRoot.find resolved inside --lora-root: all that its read may open."""

    root: OpenDirectory  # the root, held open: every walk starts at its descriptor
    directory: tuple[str, ...]  # the directory's path below the root, no symlink on it
    # Each adapter file's name -> where it led; a name missing led nowhere (nothing, a dangling symlink).
    files: Mapping[str, FoundFile]


def read_file(
    directory: int,
    name: str,
    shown: str,
    found: FoundAdapter | None,
    max_bytes: int,
    limit: str,
) -> bytes | None:
    """The whole of regular file `name` in `directory`, read from one descriptor; None where nothing is
    there. Raises AdapterError naming the file: not the file `found` says the name led to (checked
    before anything of it is told: its kind, size or bytes may be another's), not a regular file, over
    `max_bytes` (`limit` says whose bound it is), unreadable, or changed while it was read."""
    was = None if found is None else found.files.get(name)
    try:
        if found is not None and was is None:  # the name led nowhere at find: nothing there is opened
            return _absent(directory, name, shown)
        if was is not None and not was.is_regular:  # a device, a FIFO...: refused unopened
            raise AdapterError(name, f"must be a regular file in {shown}")
        fd = _open_file(directory, name, shown, found, was)
    except FileNotFoundError:  # a dangling symlink too
        return None
    except OSError as error:
        if found is not None and error.errno in _SYMLINK_REFUSED:  # a symlink standing where it was not
            raise _changed(name, shown) from None
        # strerror only: the exception's own text names the server's path
        raise AdapterError(name, f"cannot be read: {error.strerror}") from None
    try:
        before = os.fstat(fd)
        if found is not None and (None if was is None else was.identity) != FileIdentity.of(before):
            raise _changed(name, shown)
        if not stat.S_ISREG(before.st_mode):
            raise AdapterError(name, f"must be a regular file in {shown}")
        if before.st_size > max_bytes:
            raise AdapterError(name, f"has {before.st_size:,} bytes, more than the {max_bytes:,} {limit}")
        chunks = []
        num_left = before.st_size
        while num_left > 0 and (chunk := os.read(fd, min(num_left, _MAX_READ_BYTES))):
            chunks.append(chunk)
            num_left -= len(chunk)
        after = os.fstat(fd)
    except OSError as error:
        raise AdapterError(name, f"cannot be read: {error.strerror}") from None
    finally:
        os.close(fd)
    if num_left or _version(after) != _version(before):
        raise _changed(name, shown)
    return b"".join(chunks)


def _open_file(
    directory: int, name: str, shown: str, found: FoundAdapter | None, was: FoundFile | None
) -> int:
    """`name`'s descriptor: in `directory` as it leads (`found` None: the operator's), else where find saw
    it lead, by the same symlink if it was one (another swapped in since is refused), with no symlink
    followed; a name find saw lead nowhere, in `directory` as it is, never followed (refused unread)."""
    if found is None:
        if not stat.S_ISREG(os.stat(name, dir_fd=directory).st_mode):  # refused unopened, as above
            raise AdapterError(name, f"must be a regular file in {shown}")
        return os.open(name, _OPEN_FLAGS, dir_fd=directory)
    assert was is not None
    if was.link is not None:
        try:
            link = os.readlink(name, dir_fd=directory)
        except OSError as error:
            if error.errno != errno.EINVAL:  # ENOENT: gone, as a file gone is
                raise
            link = None  # no symlink now: a file swapped in for it
        if link != was.link:
            raise _changed(name, shown)
    return open_beneath(found.root.fd, was.parts, _OPEN_FLAGS)


def _absent(directory: int, name: str, shown: str) -> None:
    """None where `name`, which led nowhere when find walked it, leads nowhere yet (nothing there, a
    symlink: not followed); anything standing there now was put there since, and is refused unopened."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(status.st_mode):
        return None
    raise _changed(name, shown)


def _version(status: os.stat_result) -> tuple[int, int, int]:
    """What a write to the file moves. Not st_ino: one descriptor's file is the same inode throughout."""
    return status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _changed(name: str, shown: str) -> AdapterError:
    return AdapterError(name, f"changed while it was read (being written?): load {shown} once it is whole")
