"""The reader's proof that it shares the writer's /dev/shm and user (`shared_memory.py`'s protocol): a
probe file it creates, whose name and content it offers with every call, and the writer's check of an
offer against the file of that name in its own directory."""

from __future__ import annotations

import fcntl
import hmac
import os
import secrets
import stat
from pathlib import Path

from tandem.common.torch_part.shared_memory import (
    PROBE_PREFIX,
    SHM_DIR,
    is_name,
    is_supported,
    new_name,
    remove,
)
from tandem.common.torch_part.shm_locks import CREATE_TRIES, lock_own, remove_abandoned, remove_own

TOKEN_BYTES = 32  # a probe file's content
# A probe file this recent is never swept, locked or not: its creator locks it within microseconds of
# creating it, and a stall between the two (a stopped process) must not cost it its probe.
PROBE_GRACE_S = 10.0


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
                if not lock_own(directory, name, fd, fcntl.LOCK_SH):
                    os.close(fd)  # swept in the instant before its lock: another name
                    continue
                if os.write(fd, token) != TOKEN_BYTES:
                    raise OSError("a short write: no room")
            except BaseException as error:
                remove_own(directory, name, fd)
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
