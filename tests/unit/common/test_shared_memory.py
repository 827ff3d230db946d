"""Shared-memory segments and the co-location proof: only the names asked for are ever created or
opened, a proof holds only for the same file and token, and the digest is the documented one."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from tandem.common import shared_memory as shm


def _reference_digest(data: bytes, key: bytes) -> bytes:
    """The module note's construction in plain Python integers."""
    keys = [int(k) for k in shm._word_keys(key)]
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data) // 4 * 4, 4)]
    finish = hashlib.blake2b(len(data).to_bytes(8, "little"), key=key, digest_size=shm.DIGEST_BYTES)
    for start in range(0, len(words), shm.CHUNK_WORDS):
        chunk = words[start : start + shm.CHUNK_WORDS]
        total = sum(w * k for w, k in zip(chunk, keys, strict=False)) % 2**64
        finish.update(total.to_bytes(8, "little"))
    finish.update(data[len(data) // 4 * 4 :])
    return finish.digest()


@pytest.mark.parametrize("num_bytes", [1, 4, 7, 4 * shm.CHUNK_WORDS, 4 * shm.CHUNK_WORDS * 2 + 13])
def test_the_digest_is_the_keyed_universal_hash_finished_by_blake2b(num_bytes: int) -> None:
    data, key = os.urandom(num_bytes), os.urandom(shm.KEY_BYTES)
    assert shm.keyed_digest(data, key) == _reference_digest(data, key)


def test_the_digest_changes_with_any_word_its_top_bits_and_the_key() -> None:
    data, key = bytearray(os.urandom(3 * 4 * shm.CHUNK_WORDS)), os.urandom(shm.KEY_BYTES)
    digest = shm.keyed_digest(bytes(data), key)
    assert shm.keyed_digest(bytes(data), os.urandom(shm.KEY_BYTES)) != digest
    for position in (0, 5, 4 * shm.CHUNK_WORDS + 3, len(data) - 1):
        altered = bytearray(data)
        altered[position] ^= 0x80  # a sign bit of a float
        assert shm.keyed_digest(bytes(altered), key) != digest, position
    both = bytearray(data)  # two top bits flipped: what a mod-2^64 sum with even keys would miss
    both[3] ^= 0x80
    both[7] ^= 0x80
    assert shm.keyed_digest(bytes(both), key) != digest
    assert shm.keyed_digest(bytes(data) + b"\0", key) != digest  # the length counts


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


def test_a_call_reads_a_pool_segment_by_its_own_name_until_it_removes_that_name(tmp_path: Path) -> None:
    segment, name = shm.PooledSegment.create(tmp_path, 100), shm.new_name(shm.SEGMENT_PREFIX)
    segment.link(name)
    with pytest.raises(FileExistsError):  # a name already there is never taken over
        segment.link(name)
    segment.mapping[:5] = b"hello"  # written through the pool's mapping, after the link: one file
    reader = shm.open_segment(tmp_path, name)
    assert reader is not None and reader.num_bytes == 100
    out = bytearray(5)
    assert reader.read_into(0, out) and out == b"hello"
    assert reader.read_into(2, memoryview(out)[:3]) and out[:3] == b"llo"
    assert not reader.read_into(98, bytearray(5))  # past the end: not filled
    reader.close()
    assert shm.remove(tmp_path, name) and not shm.exists(tmp_path, name)
    assert shm.exists(tmp_path, segment.name)  # the pool keeps it
    assert shm.open_segment(tmp_path, name) is None
    assert not shm.remove(tmp_path, name)
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


def test_a_segment_name_that_is_a_link_or_not_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"rows" * 10)
    link = shm.new_name(shm.SEGMENT_PREFIX)
    (tmp_path / link).symlink_to(target)
    with pytest.raises(OSError):
        shm.open_segment(tmp_path, link)
    folder = shm.new_name(shm.SEGMENT_PREFIX)
    (tmp_path / folder).mkdir()
    with pytest.raises(PermissionError):
        shm.open_segment(tmp_path, folder)
