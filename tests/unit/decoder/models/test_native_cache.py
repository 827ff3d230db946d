"""The compiled kernel cache loads only a library this user built, and builds it once.

Loading a shared library runs its constructors. The planted libraries here write a marker file from
theirs, so "never loaded" is seen directly: the marker must not exist.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.decoder.models import native

PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) fclose(f);
}
int tandem_rms_norm(void) { return 0; }
"""


@pytest.fixture(autouse=True)
def unoptimised_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests are about the cache, not the numerics: -O0 compiles in a tenth of a second, not six.
    monkeypatch.setattr(native, "CFLAGS", ("-O0", "-fopenmp", "-fPIC", "-shared", "-std=c11"))


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def compile_planted(directory: Path, marker: Path) -> Path:
    """A library whose constructor creates `marker`."""
    source = directory / "planted.c"
    source.write_text(PLANTED_SOURCE)
    library = directory / "planted.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library), str(source)], check=True
    )
    return library


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recorded_digest(library: Path) -> str:
    return library.with_name(library.name + ".sha256").read_text().strip()


def assert_loads_our_build(directory: Path, marker: Path) -> native.NativeKernels:
    kernels = native.load_from(directory)
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    library = kernels.path
    assert sha256(library) == recorded_digest(library)
    x, weight = torch.randn(3, 8), torch.randn(8)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), expected)
    return kernels


def test_the_planted_library_would_run_its_constructor_if_loaded(tmp_path: Path) -> None:
    # The marker is what the other tests watch: loading the planted library does create it.
    marker = tmp_path / "ran"
    ctypes.CDLL(str(compile_planted(tmp_path, marker)))
    assert marker.exists()


def test_the_cache_directory_is_created_private_with_the_library_and_its_digest(tmp_path: Path) -> None:
    directory = tmp_path / "cache" / "kernels"
    library = native.build(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH) == 0
    assert sha256(library) == recorded_digest(library)


def plant_wrong_digest(library: Path, planted: Path) -> None:
    shutil.copy(planted, library)  # the digest beside it is still that of our build


def plant_without_digest(library: Path, planted: Path) -> None:
    shutil.copy(planted, library)
    library.with_name(library.name + ".sha256").unlink()


def plant_with_its_digest(library: Path, planted: Path) -> None:
    shutil.copy(planted, library)
    library.with_name(library.name + ".sha256").write_text(sha256(planted) + "\n")


def plant_group_writable(library: Path, planted: Path) -> None:
    plant_with_its_digest(library, planted)
    library.chmod(0o775)


def plant_as_a_symlink(library: Path, planted: Path) -> None:
    library.unlink()
    library.symlink_to(planted)
    library.with_name(library.name + ".sha256").write_text(sha256(planted) + "\n")


def plant_owned_by_another_user(library: Path, planted: Path) -> None:
    plant_with_its_digest(library, planted)
    os.chown(library, 12345, 12345)


PLANTINGS: dict[str, Callable[[Path, Path], None]] = {
    "wrong digest": plant_wrong_digest,
    "no digest": plant_without_digest,
    "group-writable": plant_group_writable,
    "symlink": plant_as_a_symlink,
    "another owner": plant_owned_by_another_user,
}


@pytest.mark.parametrize(
    "planting", [pytest.param(p, marks=needs_root) if p == "another owner" else p for p in PLANTINGS]
)
def test_a_library_planted_in_the_cache_never_runs_and_is_rebuilt(tmp_path: Path, planting: str) -> None:
    directory, marker = tmp_path / "kernels", tmp_path / "ran"
    library = native.build(directory)
    planted = compile_planted(tmp_path, marker)
    PLANTINGS[planting](library, planted)
    kernels = assert_loads_our_build(directory, marker)
    assert kernels.path == library and not library.is_symlink()
    assert sha256(library) != sha256(planted)


def test_a_corrupt_library_is_rebuilt_once_not_skipped_on_every_start(tmp_path: Path) -> None:
    directory, marker = tmp_path / "kernels", tmp_path / "ran"
    library = native.build(directory)
    library.write_bytes(library.read_bytes()[:1000])  # a truncated file, as a full disk leaves it
    assert_loads_our_build(directory, marker)
    rebuilt_at = library.stat().st_mtime_ns
    assert native.build(directory) == library and library.stat().st_mtime_ns == rebuilt_at


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_cache_directory_others_can_write_is_refused(
    tmp_path: Path, mode: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, marker = tmp_path / "kernels", tmp_path / "ran"
    library = native.build(directory)
    plant_with_its_digest(library, compile_planted(tmp_path, marker))
    directory.chmod(mode)
    with pytest.raises(native.UntrustedCacheError, match="writable by group or others"):
        native.load_from(directory)
    monkeypatch.setenv(native.CACHE_ENV, str(directory))
    native.load.cache_clear()
    try:
        assert native.load() is None  # logged; the model stays on torch ops
    finally:
        native.load.cache_clear()
    assert not marker.exists()


@needs_root
def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    os.chown(directory, 12345, 12345)
    with pytest.raises(native.UntrustedCacheError, match="belongs to uid 12345"):
        native.build(directory)


def _build_when_all_are_ready(directory: Path, ready: multiprocessing.synchronize.Barrier) -> None:
    ready.wait()
    native.build(directory)


def test_ranks_starting_together_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A compiler that records each build and takes a second, so that every rank asks while one builds.
    log = tmp_path / "compiles"
    compiler = tmp_path / "cc-counting"
    compiler.write_text(
        f'#!/bin/sh\ncase " $* " in *" -shared "*) echo build >> "{log}"; sleep 1;; esac\nexec cc "$@"\n'
    )
    compiler.chmod(0o700)
    monkeypatch.setenv(native.COMPILER_ENV, str(compiler))
    directory = tmp_path / "kernels"
    context = multiprocessing.get_context("fork")  # build() needs no torch in the children
    ready = context.Barrier(4)
    ranks = [context.Process(target=_build_when_all_are_ready, args=(directory, ready)) for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=120)
    assert [rank.exitcode for rank in ranks] == [0] * 4
    assert log.read_text().splitlines() == ["build"]
    library = native.build(directory)
    assert sha256(library) == recorded_digest(library)
