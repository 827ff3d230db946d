"""Host tensors in 2 MiB pages: memory that every step reads, scattered, should not cost a TLB miss a
4 KiB page.

A decode step of 32 sequences reads each one's KV blocks, 6 KB a block and layer for SmolLM2, from
wherever the block pool put them: with 4 KiB pages nearly every block is a page of its own, and the
TLB (about 3,000 entries) covers 12 MB of a pool that holds 118 MB at 160 positions a sequence.
In 2 MiB pages the tiled attention kernel over 30 such layers took 12.8-13.1 against 14.1-14.3 ms
(Zen 4, pools allocated both ways in one process, runs interleaved). Linux gives an anonymous
mapping huge pages when it is advised to (MADV_HUGEPAGE) and transparent huge pages are `madvise` or
`always`, the usual settings; torch's allocator advises only when THP_MEM_ALLOC_ENABLE is set at
start-up, and then for every allocation. Elsewhere (another OS, THP `never`) these are plain tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements whose whole 2 MiB pages are advised huge
    (its start 2 MiB-aligned; a tail shorter than a page is not advised, so this call makes nothing
    past the tensor resident). Touch it only after this returns: a page already faulted in stays
    small until the kernel's background collapse."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or _madvise is None:
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # [bytes], room to align the start
    offset = -raw.data_ptr() % HUGE_PAGE
    start = raw.data_ptr() + offset
    # A refusal (THP compiled out, an old kernel) leaves small pages: the tensor is the same.
    _madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype)  # the view holds `raw` alive


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` zeros, its whole 2 MiB pages advised huge, none of them resident
    until touched: an anonymous mapping reads as zeros and the kernel zero-fills each page as it is
    first touched. For the KV pool, whose `empty(...).zero_()` faulted in all of --kv-cache-bytes
    before serving (512 MiB: 0.4-0.6 s of every decoder start on 2 cores) though a step touches only
    the pages its blocks are in."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or _madvise is None:
        return torch.zeros(numel, dtype=dtype)
    # Private: Python's default for an anonymous map is MAP_SHARED, which is shmem, where transparent huge
    # pages are off by default (madvise is then a no-op: 4 KiB pages, the attention kernel ~10% slower)
    # and a first touch costs ~7x a private page's (43 vs 6 ms per 64 MiB here).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # [bytes]; holds `mapping` open
    offset = -raw.data_ptr() % HUGE_PAGE
    start = raw.data_ptr() + offset
    _madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype)  # the view holds `raw` alive


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


class Arena:
    """Tensors side by side in chunks of huge pages, in the order they are asked for: the weights a
    decode step streams, one after another, where most are too small (a SmolLM2 layer's are 0.7-3.5
    MB) to hold a whole 2 MiB page of their own. A chunk is freed when the last tensor in it is;
    what a chunk has not handed out is never touched, so never resident (beyond the huge page the
    last tensor ends in). Thread-safe."""

    CHUNK = 32 << 20
    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # [CHUNK] uint8
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D tensor of `numel` elements (one past a quarter chunk gets an allocation
        of its own: a chunk's tail is not left unused for it)."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.CHUNK // 4:
            return empty(numel, dtype)
        with self._lock:
            if self._chunk is None or self._used + nbytes > self.CHUNK:
                self._chunk, self._used = empty(self.CHUNK, torch.uint8), 0
            view = self._chunk[self._used : self._used + nbytes].view(dtype)
            self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return view
