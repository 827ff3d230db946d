"""Where LoadAdapter may read adapters from: the directory the operator names with --lora-root.

NOTE: what a caller can learn. A LoadAdapter path is taken relative to the root (or is an absolute path
inside it), resolved with every symlink followed, and served only if it resolves to a directory inside
the root, which the server may list and search, whose adapter files resolve inside it too. Every other
path, whatever the reason (a `..` component, an absolute path elsewhere, a symlink leading out,
nothing there, a file, a directory that cannot be read or searched), gets one refusal with one
wording, naming the field and the flag and echoing only what the caller sent, so a caller learns
nothing of the file system outside the root, nor even whether a path inside it is missing or leads
out. The adapter is then read from the resolved directory, never from the caller's path again, and
only from the files its names resolved to here (a symlink swapped in for one since is refused; one into
an HF cache's blobs/ that was there is read), and reported by its path relative to the root. What is
inside a served directory is peft_adapter's to refuse, by the file's name (one that cannot be read, is
no regular file, or changes while read).

The root's own path is resolved once, at start: a root that is a symlink retargeted later still means
the directory it named then (a restart takes the new one). Its contents are the operator's: whoever can
write there can make a directory that a later LoadAdapter follows (a symlink swapped in for a directory
above the adapter's between the check and the read included) or a hard link to any file they can reach,
so the root should hold adapters only and be writable by the operator alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tandem.client.errors import InvalidArgument
from tandem.common.model_name import echo
from tandem.decoder.models.peft_adapter import CONFIG_FILE, MAX_PATH_BYTES, WEIGHTS_FILE, FileIdentity

ROOT_FLAG = "--lora-root"


@dataclass(frozen=True)
class AdapterDirectory:
    """An adapter directory a caller named, found inside the root."""

    path: Path  # absolute, every symlink resolved: what is read
    shown: str  # relative to the root, as the caller named it (normalized): what AdapterInfo.path says
    # Each adapter file's name -> the file it resolved to inside the root; a name missing led nowhere.
    # The read takes these files only (read_adapter's `found`).
    files: Mapping[str, FileIdentity]


class AdapterRoot:
    """The directory LoadAdapter paths are taken in. Its own path is resolved once, at start."""

    def __init__(self, root: Path) -> None:
        self.given = Path(os.path.abspath(root))  # as the operator wrote it, for absolute caller paths
        self.root = Path(os.path.realpath(root, strict=True))

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
            directory = Path(os.path.realpath(self.root / relative, strict=True))
            is_served = (
                self._is_inside(directory)
                and directory.is_dir()
                and os.access(directory, os.R_OK | os.X_OK)  # else refused later in words of its own
            )
            files = self._files_inside(directory) if is_served else None
        except OSError:  # ENOENT, ELOOP, EACCES, ENAMETOOLONG...: all one answer
            files = None
        if files is None:
            raise self._refusal(path)
        return AdapterDirectory(path=directory, shown=str(relative), files=files)

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

    def _is_inside(self, real: Path) -> bool:
        return real != self.root and real.is_relative_to(self.root)

    def _files_inside(self, directory: Path) -> dict[str, FileIdentity] | None:
        """The file each adapter file's name resolves to, or None where one leads out of the root. A
        name that leads nowhere is left out: its absence is read_adapter's to report, by its name."""
        files = {}
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            file = directory / name
            if not os.path.lexists(file):
                continue
            real = Path(os.path.realpath(file))
            if not self._is_inside(real):
                return None
            try:  # the file resolved to, itself: a symlink there now was swapped in since and is refused
                files[name] = FileIdentity.of(os.stat(real, follow_symlinks=False))
            except OSError:  # a dangling symlink, a loop: read_adapter refuses the name as it finds it
                continue
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
