"""Giving a large request's memory back once it has ended.

NOTE: why this is needed. A request of tens of megabytes (an embedding tensor, a long text) is
copied several times on its way in (gRPC's receive buffers, the message, its bytes field) and ends
up in small reference cycles of gRPC's own per-call objects, which only the cyclic GC frees. An idle
server allocates too little to trigger that GC, and glibc keeps what it frees in its arenas: a
decoder refusing 60 MB requests grew by about 75 MB per request and kept it. After a request of at
least LARGE_REQUEST_BYTES ends, collecting the youngest generation (where those cycles are; about
1 ms, where a full collection takes a second on a loaded heap) and trimming the heap keeps the
process at its resting size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable

LARGE_REQUEST_BYTES = 8 * 1024 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on a libc without it (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def give_back() -> None:
    """Free the cycles a finished request left and return free heap pages to the OS."""
    gc.collect(0)
    if _TRIM is not None:
        _TRIM(0)
