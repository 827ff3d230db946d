"""Huge-page tensors: the same tensor as torch.empty's, its whole 2 MiB pages advised huge on Linux."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.common.torch_part import huge_pages
from tandem.common.torch_part.huge_pages import HUGE_PAGE


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_tensor_starts_on_a_huge_page_and_holds_its_elements() -> None:
    x = huge_pages.empty(3 * HUGE_PAGE // 2 + 5, torch.bfloat16)  # 3 MiB and 10 bytes
    assert x.shape == (3 * HUGE_PAGE // 2 + 5,) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert x.data_ptr() % HUGE_PAGE == 0
    x.fill_(2.0)
    assert x.sum(dtype=torch.float64) == 2.0 * x.numel()


def test_a_small_tensor_is_a_plain_one() -> None:
    x = huge_pages.empty(1000, torch.float32)
    assert x.shape == (1000,) and x.dtype == torch.float32


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="madvise(MADV_HUGEPAGE) needs Linux with transparent huge pages built in",
)
def test_on_linux_the_whole_pages_are_advised_huge() -> None:
    # (Whether the tail is too depends on what the allocator reused: a heap range advised before.)
    x = huge_pages.empty(2 * HUGE_PAGE + 4096, torch.uint8)  # two huge pages and a 4 KiB tail
    assert "hg" in _vm_flags(x.data_ptr())  # the kernel's mark for MADV_HUGEPAGE
    assert "hg" in _vm_flags(x.data_ptr() + 2 * HUGE_PAGE - 1)


def test_an_arena_hands_out_tensors_side_by_side_each_on_a_cache_line() -> None:
    arena = huge_pages.Arena()
    first = arena.empty(1000, torch.bfloat16)  # 2,000 bytes
    second = arena.empty(10, torch.float32)
    assert first.data_ptr() % HUGE_PAGE == 0  # a chunk starts on a huge page
    assert second.data_ptr() == first.data_ptr() + 2048  # the next cache line after the first
    first.fill_(1.0)
    second.fill_(2.0)
    assert first.eq(1.0).all() and second.eq(2.0).all()  # neither overlaps the other


def test_an_arena_starts_a_chunk_when_one_is_full_and_gives_a_large_tensor_its_own() -> None:
    arena = huge_pages.Arena()
    quarter = huge_pages.Arena.CHUNK // 4
    parts = [arena.empty(quarter, torch.uint8) for _ in range(5)]  # the fifth: a second chunk
    starts = [p.data_ptr() for p in parts]
    assert starts[1:4] == [starts[0] + i * quarter for i in (1, 2, 3)]
    assert starts[4] % HUGE_PAGE == 0 and not starts[0] <= starts[4] < starts[0] + 4 * quarter
    large = arena.empty(quarter + 1, torch.uint8)
    assert large.data_ptr() % HUGE_PAGE == 0 and large.numel() == quarter + 1
    assert arena.empty(1, torch.uint8).data_ptr() == starts[4] + quarter  # the open chunk goes on


def _smaps(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping that holds `address`: its fields, and its permissions
    under "perms" (rw-p private, rw-s shared)."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, *rest = line.split()
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            if entry is not None:
                break
            if low <= address < high:
                entry = {"perms": rest[0]}
        elif entry is not None:
            entry[head.rstrip(":")] = rest[0] if rest else ""
    if entry is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return entry


def _rss_kb(address: int) -> int:
    """The resident kB of this process's mapping that holds `address`."""
    return int(_smaps(address)["Rss"])


def test_zeros_is_a_large_tensor_of_zeros_on_a_huge_page_and_a_small_one_plain() -> None:
    x = huge_pages.zeros(3 * HUGE_PAGE // 2 + 5, torch.bfloat16)
    assert x.shape == (3 * HUGE_PAGE // 2 + 5,) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert x.data_ptr() % HUGE_PAGE == 0
    assert not x.any()
    x[-1] = 1.0  # writable, its own memory
    assert x.sum() == 1.0
    small = huge_pages.zeros(1000, torch.float32)
    assert small.shape == (1000,) and not small.any()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_zeros_makes_nothing_resident_until_touched() -> None:
    # The KV pool: --kv-cache-bytes is not faulted in (and zero-filled twice) before serving.
    x = huge_pages.zeros(64 * HUGE_PAGE, torch.uint8)  # 128 MiB
    assert _rss_kb(x.data_ptr()) < 4 * HUGE_PAGE // 1024
    x[: HUGE_PAGE // 2].fill_(1)
    assert 0 < _rss_kb(x.data_ptr()) < 4 * HUGE_PAGE // 1024
    assert int(x.sum()) == HUGE_PAGE // 2


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_zeros_is_private_memory_that_takes_huge_pages_where_the_kernel_gives_them_on_advice() -> None:
    # mmap's default MAP_SHARED made the pool shmem ("rw-s /dev/zero (deleted)"): no huge page though
    # advised, where transparent huge pages are "madvise" or "always" for private memory.
    x = huge_pages.zeros(4 * HUGE_PAGE, torch.uint8)
    x.fill_(1)
    entry = _smaps(x.data_ptr())
    assert entry["perms"].endswith("p"), entry
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if enabled.exists() and "[never]" not in enabled.read_text():
        assert int(entry["AnonHugePages"]) > 0, entry
