"""An adapter's files read whole from one descriptor: never mapped, never blocked on, refused when they
change while read or when what stands at a name is not what AdapterRoot.find saw."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.decoder.models.adapter_root import AdapterRoot
from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter

from .peft_copies import copy_with


def test_the_weights_file_is_never_memory_mapped(
    adapter_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mapped file that shrinks under the reader (`cp` over it truncates, then writes) is SIGBUS: the
    # decoder and every stream on it dead. Whatever maps the file, it is mapped while tensors are checked.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    weights = str((adapter_dir / WEIGHTS_FILE).resolve())
    mapped_while_checked = []
    isfinite = torch.isfinite

    def checking(tensor: torch.Tensor) -> torch.Tensor:
        mapped_while_checked.append(weights in maps.read_text())
        return isfinite(tensor)

    monkeypatch.setattr(torch, "isfinite", checking)
    read_adapter(adapter_dir, tiny_fp32.config, max_rank=16)
    assert mapped_while_checked and not any(mapped_while_checked)


@pytest.mark.parametrize("change", ["cut short", "rewritten"])
def test_a_weights_file_changed_while_read_is_refused(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    # What `cp` over an adapter does while a LoadAdapter reads it: truncate, then write.
    out = copy_with(adapter_dir, tmp_path / "a")
    weights = out / WEIGHTS_FILE
    whole = weights.read_bytes()
    inode, os_read = weights.stat().st_ino, os.read

    def change_then_read(fd: int, size: int) -> bytes:  # after the reader's open and fstat
        if os.fstat(fd).st_ino == inode and weights.stat().st_size == len(whole):
            weights.write_bytes(whole[: len(whole) // 2])
            if change == "rewritten":
                time.sleep(0.01)  # a later mtime, whatever the file system's clock tick
                weights.write_bytes(whole[: len(whole) // 2] + bytes(len(whole) - len(whole) // 2))
        return os_read(fd, size)

    monkeypatch.setattr(os, "read", change_then_read)
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
    assert str(refused.value) == (
        "adapter_model.safetensors: changed while it was read (being written?): load team/a once it is whole"
    )


def test_a_same_size_rewrite_that_sets_its_mtime_back_is_refused(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `cp -p` or `rsync --inplace -t` over an adapter being read: truncate, write another adapter of
    # the same size, and set the source's mtime. Size and mtime read back as they were, and the reader
    # kept half of each file's tensors; only the change time, which utime cannot set, tells.
    out = copy_with(adapter_dir, tmp_path / "a")
    weights = out / WEIGHTS_FILE
    save_file({k: v * 2 for k, v in load_file(weights).items()}, tmp_path / "b", metadata={"format": "pt"})
    other, first, os_read = (tmp_path / "b").read_bytes(), weights.stat(), os.read
    assert len(other) == first.st_size
    rewritten = []

    def rewrite_half_way(fd: int, size: int) -> bytes:
        if os.fstat(fd).st_ino != first.st_ino or rewritten:
            return os_read(fd, size)
        rewritten.append(True)
        half = os_read(fd, size // 2)
        weights.write_bytes(other)
        os.utime(weights, ns=(first.st_atime_ns, first.st_mtime_ns))
        while os.stat(weights).st_ctime_ns == first.st_ctime_ns:  # the clock's tick may not have passed
            time.sleep(0.001)
            os.utime(weights, ns=(first.st_atime_ns, first.st_mtime_ns))
        return half

    monkeypatch.setattr(os, "read", rewrite_half_way)
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
    assert str(refused.value) == (
        "adapter_model.safetensors: changed while it was read (being written?): load team/a once it is whole"
    )
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (first.st_size, first.st_mtime_ns)


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_fifo_swapped_in_for_a_file_is_refused_without_blocking(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Swapped in after any check the reader makes (is_file stands for them): its open or read waited
    # for a writer for ever, holding the one adapter-reader thread, every later load and the exit.
    out = copy_with(adapter_dir, tmp_path / "a")
    (out / name).unlink()
    os.mkfifo(out / name)
    monkeypatch.setattr(Path, "is_file", lambda self: True)
    said: list[str] = []

    def load() -> None:
        try:
            read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
        except AdapterError as error:
            said.append(str(error))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # the old reader: give it its EOF, so nothing is left blocked
        os.close(os.open(out / name, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
        pytest.fail(f"reading {name} blocked on a FIFO")
    assert said == [f"{name}: must be a regular file in team/a"]


def test_a_file_gone_after_the_checks_is_refused_without_the_server_s_path(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An operator's unlink-and-recreate during a load: safetensors' own error named the absolute path.
    out = copy_with(adapter_dir, tmp_path / "a")
    (out / WEIGHTS_FILE).unlink()
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # it was there when checked
    with pytest.raises(AdapterError) as refused:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/a")
    assert str(refused.value) == "adapter_model.safetensors: not found in team/a"


def hf_cache_root(adapter_dir: Path, root: Path) -> Path:
    """A root holding the adapter as the Hugging Face cache lays it out: a snapshot's files are symlinks
    into blobs/."""
    repo = root / "models--team--mlp8"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    for blob, name in enumerate((CONFIG_FILE, WEIGHTS_FILE)):
        (repo / "blobs" / str(blob)).write_bytes((adapter_dir / name).read_bytes())
        (repo / "snapshots" / "abc" / name).symlink_to(f"../../blobs/{blob}")
    return root


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_file_swapped_for_a_symlink_leading_out_after_find_is_refused_unread(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, name: str
) -> None:
    # A writer of --lora-root swaps a file for a symlink to one outside after find checked that every
    # name resolves inside: followed, the reader read it and echoed its values ('r: must be a positive
    # integer, got <the outside file's>'). The symlinks into blobs/ that find saw are still read.
    root = hf_cache_root(adapter_dir, tmp_path / "root")
    snapshot = "models--team--mlp8/snapshots/abc"
    found = AdapterRoot(root).find(snapshot)
    read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    outside = copy_with(adapter_dir, tmp_path / "outside", r="SECRET")
    (root / snapshot / name).unlink()
    (root / snapshot / name).symlink_to(outside / name)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert str(refused.value) == (
        f"{name}: changed while it was read (being written?): load {snapshot} once it is whole"
    )


def test_a_file_that_appeared_after_find_is_refused_unread(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # find vouched for no file by that name: one there now was put there since, from anywhere.
    root = tmp_path / "root"
    (root / "team").mkdir(parents=True)
    copy_with(adapter_dir, root / "team" / "a")
    (root / "team" / "a" / WEIGHTS_FILE).rename(tmp_path / WEIGHTS_FILE)
    found = AdapterRoot(root).find("team/a")
    (tmp_path / WEIGHTS_FILE).rename(root / "team" / "a" / WEIGHTS_FILE)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert str(refused.value) == (
        f"{WEIGHTS_FILE}: changed while it was read (being written?): load team/a once it is whole"
    )


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_adapter_file_find_saw_is_no_regular_file_is_refused_unopened(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Opened to be checked, a device acts on its open (a tape rewinds, a terminal may become the
    # server's own); what find saw stand there is refused by its type before any open, and every open
    # is O_NOCTTY (a terminal swapped in meanwhile never becomes the server's).
    root = tmp_path / "root"
    root.mkdir()
    out = copy_with(adapter_dir, root / "a")
    (out / CONFIG_FILE).unlink()
    os.mkfifo(out / CONFIG_FILE) if kind == "fifo" else (out / CONFIG_FILE).mkdir()
    found = AdapterRoot(root).find("a")
    opened: list[tuple[object, int]] = []
    os_open = os.open

    def recording_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        opened.append((path, flags))
        return os_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", recording_open)
    with pytest.raises(AdapterError) as refused:
        read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    assert str(refused.value) == f"{CONFIG_FILE}: must be a regular file in a"
    assert [path for path, _ in opened] == ["a"]  # the directory only
    (out / CONFIG_FILE).unlink() if kind == "fifo" else (out / CONFIG_FILE).rmdir()
    (out / CONFIG_FILE).write_bytes((adapter_dir / CONFIG_FILE).read_bytes())
    opened.clear()
    found = AdapterRoot(root).find("a")
    read_adapter(found.path, tiny_fp32.config, max_rank=16, shown=found.shown, found=found.found)
    files = [flags for path, flags in opened if path in (CONFIG_FILE, WEIGHTS_FILE)]
    assert len(files) == 2 and all(flags & os.O_NOCTTY for flags in files)
