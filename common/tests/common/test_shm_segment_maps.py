"""The reader's mappings: a segment is read by a call's own name only (never a link or another kind of
file), through a mapping kept for the pool segment given again, dropped once the file has no name left,
and bounded, the least recently used dropped first."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tandem.common.torch_part import shared_memory as shm
from tandem.common.torch_part import shm_digest, shm_pool, shm_segment_maps


@pytest.fixture
def reader(tmp_path: Path):
    made = shm_segment_maps.SegmentMaps(tmp_path)
    yield made
    made.close()


def test_a_read_digested_is_the_copy_and_its_keyed_digest_by_the_readers_copy_digest(tmp_path: Path) -> None:
    calls = []

    def counted(source: np.ndarray, out: np.ndarray, key: bytes) -> bytes:
        calls.append(len(source))
        return shm_digest.copy_then_digest(source, out, key)

    maps = shm_segment_maps.SegmentMaps(tmp_path, copy_digest=counted)
    segment, name = shm_pool.PooledSegment.create(tmp_path, 100), shm.new_name(shm.SEGMENT_PREFIX)
    segment.link(name)
    segment.mapping[:] = os.urandom(100)
    key = os.urandom(shm_digest.KEY_BYTES)
    with maps.open(name) as opened:
        out = np.empty(40, dtype=np.uint8)
        assert opened.read_digested(7, out, key) == shm_digest.keyed_digest(segment.mapping[7:47], key)
        assert out.tobytes() == segment.mapping[7:47]
        before = out.copy()
        assert opened.read_digested(61, out, key) is None and np.array_equal(out, before)  # past the end
    assert calls == [40]
    maps.close()
    segment.close()


def test_a_call_reads_a_pool_segment_by_its_own_name_until_it_removes_that_name(
    tmp_path: Path, reader: shm_segment_maps.SegmentMaps
) -> None:
    segment, name = shm_pool.PooledSegment.create(tmp_path, 100), shm.new_name(shm.SEGMENT_PREFIX)
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
    tmp_path: Path, reader: shm_segment_maps.SegmentMaps
) -> None:
    segment = shm_pool.PooledSegment.create(tmp_path, 4096)
    for round_ in range(3):
        name = shm.new_name(shm.SEGMENT_PREFIX)
        segment.link(name)
        segment.mapping[:4] = bytes([round_]) * 4  # the writer's next rows, in the same pages
        with reader.open(name) as opened:
            out = bytearray(4)
            assert opened.read_into(0, out) and out == bytes([round_]) * 4
        shm.remove(tmp_path, name)
    assert reader.num_mapped == 1 and reader.num_kept == 1
    other = shm_pool.PooledSegment.create(tmp_path, 4096)  # another file, the same size: a mapping of its own
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
    reader = shm_segment_maps.SegmentMaps(tmp_path, sweep_s=0.05)
    try:
        segment, name = shm_pool.PooledSegment.create(tmp_path, 4096), shm.new_name(shm.SEGMENT_PREFIX)
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
    reader = shm_segment_maps.SegmentMaps(tmp_path, max_maps=2, max_bytes=3 * 4096)
    pool = [shm_pool.PooledSegment.create(tmp_path, 4096) for _ in range(3)]
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
        big = shm_pool.PooledSegment.create(tmp_path, 4 * 4096)  # past max_bytes: mapped, never kept
        name = shm.new_name(shm.SEGMENT_PREFIX)
        big.link(name)
        reader.open(name).close()
        assert reader.num_kept == 2 and reader.num_mapped == 5
        big.close()
    finally:
        reader.close()
        for segment in pool:
            segment.close()


def test_a_segment_name_that_is_a_link_or_not_a_file_is_refused(
    tmp_path: Path, reader: shm_segment_maps.SegmentMaps
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
