"""Where LoadAdapter may read adapters from: the directory the operator names with --lora-root.

NOTE: what a caller can learn. A LoadAdapter path is taken relative to the root (or is an absolute path
inside it), resolved with every symlink followed as long as it stays inside, and served only if it leads
to a directory inside the root, which the server may list and search, whose adapter files lead inside
it too. Every other path, whatever the reason (a `..` component, an absolute path elsewhere, a symlink
leading out, nothing there, a file, a directory that cannot be read or searched), gets one refusal
with one wording, naming the field and the flag and echoing only what the caller sent, so a caller
learns nothing of the file system outside the root, nor even whether a path inside it is missing or
leads out. The adapter is reported by its path relative to the root. What is inside a served directory
is peft_adapter's to refuse, by the file's name (one that cannot be read, is no regular file, or
changes while read).

NOTE: how the root is walked. The root is opened once, at start, and every path below it is walked from
that descriptor one component at a time with O_NOFOLLOW (beneath.py): a symlink inside the root is
resolved by walking its target from the root again, never by the kernel, so one leading out is refused
whether it was there or is swapped in for any directory on the way while find walks (or between find
and the read: the read walks again from the root, along the path find resolved, which holds no
symlink). find gives the read that path and the file each adapter name led to (`FoundAdapter`), and the
read takes those files only (an HF cache's snapshot, its files symlinked into blobs/, reads the blobs).
A root that is a symlink retargeted later still means the directory it named at start (a restart takes
the new one), as does a root renamed (served where it now lies) or removed (every load is refused as
such, FAILED_PRECONDITION, until a restart); an absolute symlink inside it is followed where it names
the root by either path. Its contents are the operator's: whoever can write there can plant a hard link
to any file they can reach, which the server then reads as its own, so the root should hold adapters
only and be writable by the operator alone.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.common.model_name import echo
from tandem.decoder.models.adapter_files import FileIdentity, FoundAdapter, FoundFile
from tandem.decoder.models.beneath import LeadsOut, OpenDirectory, open_beneath, resolve
from tandem.decoder.models.peft_adapter import CONFIG_FILE, MAX_PATH_BYTES
from tandem.decoder.models.peft_weights import WEIGHTS_FILE

ROOT_FLAG = "--lora-root"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterDirectory:
    """An adapter directory a caller named, found inside the root."""

    path: Path  # absolute, every symlink resolved: where it was found, for logs (never opened by it)
    shown: str  # relative to the root, as the caller named it (normalized): what AdapterInfo.path says
    found: FoundAdapter  # what the read opens: the directory and its files, from the root's descriptor


class AdapterRoot:
    """The directory LoadAdapter paths are taken in. Its own path is resolved once, at start."""

    def __init__(self, root: Path) -> None:
        self.given = Path(os.path.abspath(root))  # as the operator wrote it, for absolute caller paths
        self.root = Path(os.path.realpath(root, strict=True))
        self._root = OpenDirectory(self.root)  # every walk's start, whatever its path names later
        self._told_removed = threading.Lock()  # held for good once the root's removal is logged

    def find(self, path: str) -> AdapterDirectory:
        """The directory `path` names inside the root. Raises InvalidArgument("path") otherwise, with one
        wording whatever is wrong, except for a NUL or an over-long path, which are refused by what
        they are (nothing of the file system is asked about them)."""
        if "\0" in path:
            raise InvalidArgument("path", "must not hold a NUL character")
        if (num_bytes := len(path.encode())) > MAX_PATH_BYTES:
            raise InvalidArgument("path", f"must be at most {MAX_PATH_BYTES} bytes, got {num_bytes}")
        relative = self._relative(PurePosixPath(path))
        if relative is None or relative == PurePosixPath(".") or ".." in relative.parts:
            raise self._refusal(path)
        try:
            parts = resolve(self._root.fd, relative, self._relative).parts
            if not parts:  # the root itself
                raise self._refusal(path)
            directory = open_beneath(self._root.fd, parts, os.O_RDONLY | os.O_DIRECTORY)
            try:
                files = self._files_inside(parts, directory)
            finally:
                os.close(directory)
        except (OSError, LeadsOut):  # ENOENT, ELOOP, EACCES, ENAMETOOLONG...: all one answer
            self._check_not_removed()
            raise self._refusal(path) from None
        found = FoundAdapter(root=self._root, directory=parts, files=files)
        return AdapterDirectory(path=self.root.joinpath(*parts), shown=str(relative), found=found)

    def shown(self, path: Path) -> str:
        """How a start-up adapter (--lora, the operator's own, anywhere) is reported to every caller:
        relative to the root when it lies inside it, as the operator named it (a symlink inside the
        root by its own name, as LoadAdapter reports the name its caller gave), or else where it
        resolves inside; outside, by its directory's name alone, as the server's paths are no
        caller's business."""
        relative = self._relative(PurePosixPath(os.path.abspath(path)))
        if relative is None or relative == PurePosixPath("."):
            try:
                real = Path(os.path.realpath(path, strict=True))
            except OSError:
                return start_up_shown(path)
            if not self._is_inside(real):
                return start_up_shown(path)
            relative = PurePosixPath(real.relative_to(self.root))
        return str(relative)

    def _relative(self, path: PurePosixPath) -> PurePosixPath | None:
        """`path` relative to the root: as it is, or, absolute, the part under the root as given or as
        resolved; None for an absolute path under neither."""
        if not path.is_absolute():
            return path
        for root in (self.given, self.root):
            if path.is_relative_to(root):
                return path.relative_to(root)
        return None

    def _check_not_removed(self) -> None:
        """Raises FailedPrecondition where the root was removed after start: the directory held open is
        empty for good and every path in it leads nowhere, which the one refusal would blame on the
        caller's path. It names the flag, never the root's path (no caller's business); the operator is
        told once, in the log, where the path is theirs. A root renamed since is still the directory
        held open, and is served where it now lies."""
        if os.fstat(self._root.fd).st_nlink != 0:
            return
        if self._told_removed.acquire(blocking=False):
            log.error(
                "%s %s was removed after start: LoadAdapter refuses every path until a restart",
                ROOT_FLAG,
                self.root,
            )
        raise FailedPrecondition(
            "path",
            f"the server's {ROOT_FLAG} was removed after it started: it loads no adapter until restarted",
        )

    def _is_inside(self, real: Path) -> bool:
        return real != self.root and real.is_relative_to(self.root)

    def _files_inside(self, parts: tuple[str, ...], directory: int) -> dict[str, FoundFile]:
        """Where each adapter file's name in the directory open as `directory` (at `parts` below the root)
        leads. Raises LeadsOut where one leads out of the root, OSError where the directory cannot be
        searched. A name that leads nowhere is left out: its absence is read_adapter's to report, by its
        name."""
        files = {}
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            try:
                entry = os.stat(name, dir_fd=directory, follow_symlinks=False)
                link = os.readlink(name, dir_fd=directory) if stat.S_ISLNK(entry.st_mode) else None
            except FileNotFoundError:
                continue
            try:
                file = resolve(self._root.fd, PurePosixPath(*parts, name), self._relative)
            except OSError:  # a dangling symlink, a loop: read_adapter refuses the name as it finds it
                continue
            files[name] = FoundFile(
                link=link,
                parts=file.parts,
                identity=FileIdentity.of(file.status),
                file_type=stat.S_IFMT(file.status.st_mode),
            )
        return files

    def _refusal(self, path: str) -> InvalidArgument:
        return InvalidArgument(
            "path",
            f"must name an adapter directory inside the server's {ROOT_FLAG}, relative to it and without "
            f"'..', got {echo(path)}",
        )


def start_up_shown(path: Path) -> str:
    """How a start-up adapter outside any --lora-root is reported: its directory's name, never the
    server's path to it."""
    return Path(os.path.abspath(path)).name or str(path)
