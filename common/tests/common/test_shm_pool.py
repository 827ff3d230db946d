"""A writer's pool segment: created under a pool name, its pages allocated, readable by its user only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tandem.common.torch_part import shared_memory as shm
from tandem.common.torch_part import shm_pool


def test_a_pool_segment_is_created_its_pages_allocated_readable_by_its_user_only(tmp_path: Path) -> None:
    segment = shm_pool.PooledSegment.create(tmp_path, 100_000)
    assert shm.is_name(segment.name, shm.POOL_PREFIX)
    info = os.stat(tmp_path / segment.name)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 100_000 == len(segment.mapping)
    assert info.st_blocks * 512 >= 100_000  # allocated now: no write into it waits for a page
    segment.close()
    assert not list(tmp_path.iterdir())
