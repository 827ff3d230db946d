"""Shared-memory segments and the co-location proof: only the names asked for are ever created or
opened, a proof holds only for the same file and token, and the digest is AES-256-GMAC (against its
specification worked in plain integers, a published tag and the library's own one-shot)."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tandem.common.torch_part import shared_memory as shm


def _gf_multiply(x: int, y: int) -> int:
    """x * y in GCM's GF(2^128), on blocks read as big-endian integers (bit 0 of a block is its top
    bit: SP 800-38D's algorithm 1, shifting right and reducing by R = 0xe1 << 120)."""
    product, v = 0, y
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            product ^= v
        v = (v >> 1) ^ (0xE1 << 120) if v & 1 else v >> 1
    return product


def _reference_gmac(data: bytes, key: bytes) -> bytes:
    """GMAC by SP 800-38D in plain Python integers, AES's block function the only borrowed part:
    H = E(0^128), GHASH over the data zero-padded to blocks and its length block, masked by E(J0)."""
    block = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    h = int.from_bytes(block.update(bytes(16)), "big")
    j0 = shm.DIGEST_NONCE + (1).to_bytes(4, "big")
    padded = data + bytes(-len(data) % 16)
    lengths = (8 * len(data)).to_bytes(8, "big") + (0).to_bytes(8, "big")  # of the data, of no text
    ghash = 0
    for i in range(0, len(padded + lengths), 16):
        ghash = _gf_multiply(ghash ^ int.from_bytes((padded + lengths)[i : i + 16], "big"), h)
    return (ghash ^ int.from_bytes(block.update(j0), "big")).to_bytes(16, "big")


@pytest.mark.parametrize("num_bytes", [0, 1, 15, 16, 17, 100, 1000])
def test_the_digest_is_gmac_by_its_specification(num_bytes: int) -> None:
    data, key = os.urandom(num_bytes), os.urandom(shm.KEY_BYTES)
    assert shm.keyed_digest(data, key) == _reference_gmac(data, key)


def test_the_digest_of_nothing_under_the_zero_key_is_the_published_gcm_tag() -> None:
    # McGrew and Viega's GCM test case 13: AES-256, K = 0, IV = 0, no text, no associated data.
    assert shm.keyed_digest(b"", bytes(32)).hex() == "530f8afbc74536b9a963b4f1c4cb738b"


@pytest.mark.parametrize("num_bytes", [1, 4096, 576 * 64 * 2 + 3])
def test_the_digest_is_the_librarys_one_shot_gmac_fed_in_parts_or_whole(
    num_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, key = os.urandom(num_bytes), os.urandom(shm.KEY_BYTES)
    one_shot = AESGCM(key).encrypt(shm.DIGEST_NONCE, b"", data)  # no text: the tag alone
    assert shm.keyed_digest(data, key) == one_shot
    monkeypatch.setattr(shm, "DIGEST_UPDATE_BYTES", 1000)  # what a > 1 GiB segment does, in small
    assert shm.keyed_digest(memoryview(data), key) == one_shot


def test_the_digest_changes_with_any_bit_the_length_and_the_key() -> None:
    data, key = bytearray(os.urandom(3 * 16384)), os.urandom(shm.KEY_BYTES)
    digest = shm.keyed_digest(bytes(data), key)
    assert len(digest) == shm.DIGEST_BYTES
    assert shm.keyed_digest(bytes(data), os.urandom(shm.KEY_BYTES)) != digest
    for position in (0, 5, 16384 + 3, len(data) - 1):
        altered = bytearray(data)
        altered[position] ^= 0x80  # a sign bit of a float
        assert shm.keyed_digest(bytes(altered), key) != digest, position
    both = bytearray(data)  # two bits flipped at once
    both[3] ^= 0x80
    both[7] ^= 0x80
    assert shm.keyed_digest(bytes(both), key) != digest
    assert shm.keyed_digest(bytes(data) + b"\0", key) != digest  # the length counts, zeros too


def test_a_probe_proves_only_its_own_file_token_and_user(tmp_path: Path) -> None:
    probe = shm.Probe.create(tmp_path)
    assert probe is not None
    assert shm.is_name(probe.name, shm.PROBE_PREFIX)
    assert stat.S_IMODE(os.stat(tmp_path / probe.name).st_mode) == 0o600
    assert shm.probe_matches(tmp_path, probe.name, probe.token)
    assert not shm.probe_matches(tmp_path, probe.name, os.urandom(shm.TOKEN_BYTES))
    assert not shm.probe_matches(tmp_path, shm.new_name(shm.PROBE_PREFIX), probe.token)
    elsewhere = tmp_path / "elsewhere"  # another host's /dev/shm: the file is not there
    elsewhere.mkdir()
    assert not shm.probe_matches(elsewhere, probe.name, probe.token)
    probe.close()
    assert not shm.probe_matches(tmp_path, probe.name, probe.token)


def test_a_probe_name_that_could_leave_the_directory_is_never_opened(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * shm.TOKEN_BYTES)
    inside = tmp_path / "shm"
    inside.mkdir()
    for name in ("../secret", "secret", "tandem-probe-" + "0" * 31, "tandem-probe-" + "A" * 32):
        assert not shm.probe_matches(inside, name, b"x" * shm.TOKEN_BYTES)
    link = shm.new_name(shm.PROBE_PREFIX)
    (inside / link).symlink_to(secret)  # a link to a file holding the token: not followed
    assert not shm.probe_matches(inside, link, b"x" * shm.TOKEN_BYTES)


def test_a_pool_segment_is_created_its_pages_allocated_readable_by_its_user_only(tmp_path: Path) -> None:
    segment = shm.PooledSegment.create(tmp_path, 100_000)
    assert shm.is_name(segment.name, shm.POOL_PREFIX)
    info = os.stat(tmp_path / segment.name)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 100_000 == len(segment.mapping)
    assert info.st_blocks * 512 >= 100_000  # allocated now: no write into it waits for a page
    segment.close()
    assert not list(tmp_path.iterdir())


@pytest.fixture
def reader(tmp_path: Path):
    made = shm.SegmentMaps(tmp_path)
    yield made
    made.close()


def test_a_read_digested_is_the_copy_and_its_keyed_digest_by_the_readers_copy_digest(tmp_path: Path) -> None:
    calls = []

    def counted(source: np.ndarray, out: np.ndarray, key: bytes) -> bytes:
        calls.append(len(source))
        return shm.copy_then_digest(source, out, key)

    maps = shm.SegmentMaps(tmp_path, copy_digest=counted)
    segment, name = shm.PooledSegment.create(tmp_path, 100), shm.new_name(shm.SEGMENT_PREFIX)
    segment.link(name)
    segment.mapping[:] = os.urandom(100)
    key = os.urandom(shm.KEY_BYTES)
    with maps.open(name) as opened:
        out = np.empty(40, dtype=np.uint8)
        assert opened.read_digested(7, out, key) == shm.keyed_digest(segment.mapping[7:47], key)
        assert out.tobytes() == segment.mapping[7:47]
        before = out.copy()
        assert opened.read_digested(61, out, key) is None and np.array_equal(out, before)  # past the end
    assert calls == [40]
    maps.close()
    segment.close()


def test_a_call_reads_a_pool_segment_by_its_own_name_until_it_removes_that_name(
    tmp_path: Path, reader: shm.SegmentMaps
) -> None:
    segment, name = shm.PooledSegment.create(tmp_path, 100), shm.new_name(shm.SEGMENT_PREFIX)
    segment.link(name)
    with pytest.raises(FileExistsError):  # a name already there is never taken over
        segment.link(name)
    segment.mapping[:5] = b"hello"  # written through the pool's mapping, after the link: one file
    opened = reader.open(name)
    assert opened is not None and opened.num_bytes == 100
    out = bytearray(5)
    assert opened.read_into(0, out) and out == b"hello"
    assert opened.read_into(2, memoryview(out)[:3]) and out[:3] == b"llo"
    assert not opened.read_into(98, out) and out == b"llolo"  # past the end: untouched
    opened.close()
    assert shm.remove(tmp_path, name) and not shm.exists(tmp_path, name)
    assert shm.exists(tmp_path, segment.name)  # the pool keeps it
    assert reader.open(name) is None
    assert not shm.remove(tmp_path, name)
    segment.close()


def test_a_pool_segment_given_again_under_a_new_name_is_read_through_the_mapping_kept(
    tmp_path: Path, reader: shm.SegmentMaps
) -> None:
    segment = shm.PooledSegment.create(tmp_path, 4096)
    for round_ in range(3):
        name = shm.new_name(shm.SEGMENT_PREFIX)
        segment.link(name)
        segment.mapping[:4] = bytes([round_]) * 4  # the writer's next rows, in the same pages
        with reader.open(name) as opened:
            out = bytearray(4)
            assert opened.read_into(0, out) and out == bytes([round_]) * 4
        shm.remove(tmp_path, name)
    assert reader.num_mapped == 1 and reader.num_kept == 1
    other = shm.PooledSegment.create(tmp_path, 4096)  # another file, the same size: a mapping of its own
    other.mapping[:4] = b"else"
    name = shm.new_name(shm.SEGMENT_PREFIX)
    other.link(name)
    with reader.open(name) as opened:
        out = bytearray(4)
        assert opened.read_into(0, out) and out == b"else"  # its own bytes, never the kept file's
    assert reader.num_mapped == 2 and reader.num_kept == 2
    shm.remove(tmp_path, name)
    other.close()
    segment.close()


def _mapped_here(path: Path) -> bool:
    """This process maps the file it opened as `path` (Linux lists each mapping with the path it was
    opened by, "(deleted)" after it once removed)."""
    return str(path) in Path("/proc/self/maps").read_text()


def test_the_mapping_of_a_segment_given_back_is_dropped_with_no_call_to_trigger_it(tmp_path: Path) -> None:
    reader = shm.SegmentMaps(tmp_path, sweep_s=0.05)
    try:
        segment, name = shm.PooledSegment.create(tmp_path, 4096), shm.new_name(shm.SEGMENT_PREFIX)
        segment.link(name)
        reader.open(name).close()
        shm.remove(tmp_path, name)
        time.sleep(0.2)
        assert reader.num_kept == 1 and _mapped_here(tmp_path / name)  # the pool has it: kept for next time
        segment.close()  # given back: no name left, and the reader must not hold its pages
        deadline = time.monotonic() + 5
        while _mapped_here(tmp_path / name) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _mapped_here(tmp_path / name)
    finally:
        reader.close()


def test_mappings_are_bounded_the_least_recently_used_dropped_never_one_being_read(tmp_path: Path) -> None:
    reader = shm.SegmentMaps(tmp_path, max_maps=2, max_bytes=3 * 4096)
    pool = [shm.PooledSegment.create(tmp_path, 4096) for _ in range(3)]
    names = [shm.new_name(shm.SEGMENT_PREFIX) for _ in pool]
    try:
        for segment, name in zip(pool, names, strict=True):
            segment.link(name)
            segment.mapping[:1] = name[-1:].encode()
        first = reader.open(names[0])
        second = reader.open(names[1])
        third = reader.open(names[2])  # both kept ones are being read: mapped for this read only
        assert reader.num_kept == 2 and reader.num_mapped == 3
        for opened, name in zip((first, second, third), names, strict=True):
            out = bytearray(1)
            assert opened.read_into(0, out) and out == name[-1:].encode()
            opened.close()
        reader.open(names[2]).close()  # now the least recently used (the first) makes room
        assert reader.num_kept == 2 and reader.num_mapped == 4
        reader.open(names[1]).close()
        assert reader.num_mapped == 4  # still kept
        big = shm.PooledSegment.create(tmp_path, 4 * 4096)  # past max_bytes: mapped, never kept
        name = shm.new_name(shm.SEGMENT_PREFIX)
        big.link(name)
        reader.open(name).close()
        assert reader.num_kept == 2 and reader.num_mapped == 5
        big.close()
    finally:
        reader.close()
        for segment in pool:
            segment.close()


def test_only_the_pool_segments_of_a_writer_that_died_are_removed(tmp_path: Path) -> None:
    live = shm.PooledSegment.create(tmp_path, 100)
    abandoned = shm.new_name(shm.POOL_PREFIX)  # what a killed writer leaves: a file nobody has locked
    (tmp_path / abandoned).write_bytes(bytes(100))
    other = tmp_path / ("tandem-pool-" + "0" * 31)  # not a pool name: never touched
    other.write_bytes(b"x")
    assert shm.remove_abandoned(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    live.close()
    assert shm.remove_abandoned(tmp_path / "no-such-directory") == 0


def test_a_segment_name_that_is_a_link_or_not_a_file_is_refused(
    tmp_path: Path, reader: shm.SegmentMaps
) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"rows" * 10)
    link = shm.new_name(shm.SEGMENT_PREFIX)
    (tmp_path / link).symlink_to(target)
    with pytest.raises(OSError):
        reader.open(link)
    folder = shm.new_name(shm.SEGMENT_PREFIX)
    (tmp_path / folder).mkdir()
    with pytest.raises(PermissionError):
        reader.open(folder)
    empty = shm.new_name(shm.SEGMENT_PREFIX)
    (tmp_path / empty).write_bytes(b"")
    with pytest.raises(PermissionError):
        reader.open(empty)
    assert reader.num_mapped == 0


def _age(path: Path, seconds: float = 3600.0) -> None:
    """Makes `path` (not a link it may be) look modified `seconds` ago: past any grace period."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


# What a reader or a writer that is then killed leaves: its files, made by the module's own code, and
# their names on stdout once made.
_CHILD = """
import sys, time
from pathlib import Path
from tandem.common.torch_part import shared_memory as shm
directory = Path(sys.argv[1])
if sys.argv[2] == "probe":
    print(shm.Probe.create(directory).name, flush=True)
else:
    segment, name = shm.PooledSegment.create(directory, 4096), shm.new_name(shm.SEGMENT_PREFIX)
    segment.link(name)  # leased to a call when the writer died
    print(segment.name, name, flush=True)
time.sleep(60)
"""


@pytest.fixture
def spawn(tmp_path: Path):
    """Starts processes making files in tmp_path; returns (process, names made). Every one is killed."""
    started: list[subprocess.Popen] = []

    def start(kind: str) -> subprocess.Popen:
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(tmp_path), kind], stdout=subprocess.PIPE, text=True
            )
        )
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()
        process.stdout.close()


def _made(process: subprocess.Popen) -> list[str]:
    return process.stdout.readline().split()


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)  # no handler, no `close`: what the OOM killer does
    process.wait()


def test_a_killed_readers_probe_is_removed_by_the_next_probe_and_a_live_ones_never(
    tmp_path: Path, spawn
) -> None:
    killed, alive = spawn("probe"), spawn("probe")
    (killed_probe,), (live_probe,) = _made(killed), _made(alive)
    own = shm.Probe.create(tmp_path)  # a live probe of this process
    _kill(killed)
    for name in (killed_probe, live_probe, own.name):
        _age(tmp_path / name)  # all past the grace period: only the lock tells them apart
    new = shm.Probe.create(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_probe, own.name, new.name])
    assert shm.probe_matches(tmp_path, own.name, own.token) and shm.probe_matches(
        tmp_path, new.name, new.token
    )
    _kill(alive)
    shm.Probe.create(tmp_path).close()  # the next one finds it abandoned too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own.name, new.name])
    own.close()
    new.close()
    assert not list(tmp_path.iterdir())


def test_a_probe_sweep_touches_nothing_but_old_unlocked_probe_files_of_this_user(tmp_path: Path) -> None:
    abandoned = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    abandoned.write_bytes(bytes(shm.TOKEN_BYTES))
    young = tmp_path / shm.new_name(shm.PROBE_PREFIX)  # unlocked, but maybe between creation and lock
    young.write_bytes(bytes(shm.TOKEN_BYTES))
    kept = [young]
    for name in (
        "other",
        "tandem-probe-" + "0" * 31,
        "tandem-probe-" + "A" * 32,
        "tandem-probe-x" + "0" * 32,
    ):
        (tmp_path / name).write_bytes(bytes(shm.TOKEN_BYTES))
        kept.append(tmp_path / name)
    target = tmp_path / "target"  # an unlocked file, reached through a link named like a probe
    target.write_bytes(bytes(shm.TOKEN_BYTES))
    link = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    link.symlink_to(target)
    folder = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    folder.mkdir()
    fifo = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    os.mkfifo(fifo)
    kept += [target, link, folder, fifo]
    if os.geteuid() == 0:  # root may own files of another user: one named like a probe stays
        foreign = tmp_path / shm.new_name(shm.PROBE_PREFIX)
        foreign.write_bytes(bytes(shm.TOKEN_BYTES))
        os.chown(foreign, 65534, 65534)
        kept.append(foreign)
    for path in [abandoned] + kept:
        if path != young:
            _age(path)
    probe = shm.Probe.create(tmp_path)
    assert not os.path.lexists(abandoned)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([probe.name] + [p.name for p in kept])
    assert link.is_symlink() and target.read_bytes() == bytes(shm.TOKEN_BYTES)
    probe.close()


def test_a_killed_writers_pool_segments_and_the_call_names_linked_to_them_are_removed(
    tmp_path: Path, spawn
) -> None:
    killed = spawn("pool")
    dead_pool, dead_call = _made(killed)
    _kill(killed)
    live, live_call = shm.PooledSegment.create(tmp_path, 4096), shm.new_name(shm.SEGMENT_PREFIX)
    live.link(live_call)  # a live writer's lease: locked through its pool's file
    assert {dead_pool, dead_call} <= {p.name for p in tmp_path.iterdir()}
    assert shm.remove_abandoned(tmp_path) == 2  # the call name held the dead pool's pages as well
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, live_call])
    shm.remove(tmp_path, live_call)
    live.close()


def test_a_probe_swept_before_its_lock_is_made_again_under_a_new_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two readers starting at once: one's sweep finds the other's new file not yet locked."""
    flock, swept = shm.fcntl.flock, []

    def sweep_first(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_SH and not swept:
            swept.append(os.readlink(f"/proc/self/fd/{fd}"))
            assert shm.remove_abandoned(tmp_path, (shm.PROBE_PREFIX,), 0.0) == 1  # the other's sweep
        flock(fd, operation)

    monkeypatch.setattr(shm.fcntl, "flock", sweep_first)
    probe = shm.Probe.create(tmp_path)
    assert probe is not None and len(swept) == 1 and not swept[0].endswith(probe.name)
    assert [p.name for p in tmp_path.iterdir()] == [probe.name]
    assert shm.probe_matches(tmp_path, probe.name, probe.token)
    assert shm.remove_abandoned(tmp_path, (shm.PROBE_PREFIX,), 0.0) == 0  # locked now
    probe.close()


# The fork happens in a fresh interpreter: forking pytest's own process, which holds earlier tests'
# gRPC and tracing threads, can leave the child stuck on a lock one of them held (one clean CI run hung
# 300 s in waitpid), and a single-threaded parent is what the probe's pid check is about anyway.
_FORK = """
import os, sys
from pathlib import Path
from tandem.common.torch_part import shared_memory as shm
directory = Path(sys.argv[1])
probe = shm.Probe.create(directory)
child = os.fork()
if child == 0:  # the child's copy closed, as its exit or its own cleanup would
    probe.close()
    os._exit(0)
status = os.waitpid(child, 0)[1]
kept = shm.probe_matches(directory, probe.name, probe.token)
swept = shm.remove_abandoned(directory, (shm.PROBE_PREFIX,), 0.0)
probe.close()
print(status, kept, swept, len(list(directory.iterdir())))
"""


def test_a_forked_child_keeps_its_parents_probe_locked_and_never_removes_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORK, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    # the child exited 0; the file is still the parent's; its creator lives, so it is locked and no
    # sweep removes it; the parent's own close removes it
    assert done.stdout.split() == ["0", "True", "0", "0"]
