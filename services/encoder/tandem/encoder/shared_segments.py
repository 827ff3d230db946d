"""The encoder's shared-memory segments: an Embed reply's rows for a caller on this host.

A call whose `shared_memory` offer proves it shares this host's /dev/shm and user
(`tandem.common.torch_part.shared_memory`) gets a `SharedTarget`; its batch writes the rows into a segment of
the pool and answers with the handle instead of the bytes. An embedder that can (`EmbedsInto`: a
lookup's gather) writes them straight into the segment, given a view of it (`write_with`): the copy
of rows made elsewhere first (`write`) is a pass over them of its own, a sixth of a 4.7 MB move.

NOTE: the pool. Segments are created once, their pages allocated and mapped for good, and used again
and again: creating a segment's pages and freeing them cost 20-40 times copying the rows into pages
already there (docs/PERFORMANCE.md). Each segment is free or leased to one call. A call leases the
smallest free segment that holds its rows (or a new one, its size rounded up to a power of two so that
rows of a like size find it again), under the name its offer asked for: a second name for the
segment's file. The lease ends when the reader removes that name (it has copied the rows), or when its
`lease_s` has run out since the reply was made (the writer then removes the name: a reply lost with a
cancelled call), or when the call that asked for it ends before its reply is sent (`abandon`: the
caller cancelled it; a name not linked yet is then never linked). Only then is the segment written
again, and the bytes a longer reply left past the new rows are zeroed first: a reader maps the whole
segment, and one caller's rows must not reach another (a memset: 14 µs for 1 MiB, half a copy of as
many rows). The lease is the call's own `SharedTarget`, not its name: another caller may offer the
same name (it sees the names in /dev/shm), and its call, whose link of it fails, must not end this
one's lease. The pool is bounded in segments and bytes, leased or free: when a call finds no free
segment and no room for a new one, even once the free segments that do not fit are given back, or when
the name is taken, its reply carries bytes as usual, so sharing never fails or delays a call. A
segment free for `idle_s` is given back; so is every one on `close`, and a new pool removes what one
that died left (its segments are locked while it lives). A thread of its own ends leases and gives
segments back, every quarter lease.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common.torch_part import shared_memory, shm_digest, shm_locks, shm_pool, shm_probe, tensors

log = logging.getLogger(__name__)

IDLE_S = 60.0  # a free segment unused this long is given back: the pool shrinks when replies stop


@dataclass(frozen=True, eq=False)
class SharedTarget:
    """Where one call's rows go: the name its offer asked for, digested under its key. Equal only to
    itself (eq=False): two calls that offered the same name and key are still two calls, and one's
    `abandon` ends only its own lease."""

    segments: SharedSegments
    name: str  # "tandem-rows-<32 hex>", the offer's
    key: bytes  # [KEY_BYTES] the offer's digest key

    def write(self, rows: torch.Tensor, dtype: torch.dtype | None) -> tensor_pb2.SharedTensor | None:
        """The handle of `rows` (cast to `dtype`) copied into a segment; None: send bytes instead."""
        shape, dtype = list(rows.shape), dtype or rows.dtype
        return self.write_with(shape, dtype, lambda out: tensors.copy_into(out, rows))

    def write_with(
        self, shape: list[int], dtype: torch.dtype, fill: Callable[[torch.Tensor], None]
    ) -> tensor_pb2.SharedTensor | None:
        """The handle of the rows `fill` writes straight into a segment, given a writable view of it
        ([*shape] of `dtype`, to be dropped when it returns): no copy of the rows of its own. None:
        no segment (`fill` not called), send bytes instead."""
        return self.segments.write(self, shape, dtype, fill)


@dataclass
class _Slot:
    """One segment of the pool."""

    segment: shm_pool.PooledSegment  # mapped for writing since it was created
    lease: SharedTarget | None = None  # the call it is leased to, its name linked to it; None: free
    expires: float = math.inf  # time.monotonic() when the lease runs out; inf while being written
    last_used: float = 0.0  # time.monotonic() when it was last freed
    # Bytes from the start that may hold a call's rows: what the next, shorter, reply zeroes past its own.
    high_water: int = 0


class SharedSegments:
    def __init__(
        self, directory: Path, max_bytes: int, max_segments: int, lease_s: float, idle_s: float = IDLE_S
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self.lease_s = lease_s
        self.idle_s = idle_s
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()  # the worker threads (tower, text) write, the sweeper sweeps
        self.num_written = 0  # replies sent as segments (tests, the benchmark)
        self.num_expired = 0  # leases that ran out unread
        self.num_created = 0  # segments created: what the pool saves is num_written - num_created
        # Calls that ended before their rows were written, by time.monotonic() then: never linked. Kept a
        # lease (a batch later than that is answered by the lease anyway).
        self._abandoned: dict[SharedTarget, float] = {}
        # A pool left by an encoder that was killed would hold its pages until the host restarts.
        self.num_abandoned = shm_locks.remove_abandoned(directory)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(
            target=self._sweep_until_stopped, name="encoder-segments", daemon=True
        )
        self._sweeper.start()

    def target(self, offer: encoder_pb2.SharedMemoryOffer) -> SharedTarget | None:
        """The offer's target when its proof holds; None (bytes in the reply) otherwise."""
        if not shared_memory.is_name(offer.segment_name, shared_memory.SEGMENT_PREFIX):
            return None
        if len(offer.digest_key) != shm_digest.KEY_BYTES:
            return None
        if not shm_probe.probe_matches(self.directory, offer.probe_name, offer.probe_token):
            return None
        return SharedTarget(self, offer.segment_name, offer.digest_key)

    def write(
        self, target: SharedTarget, shape: list[int], dtype: torch.dtype, fill: Callable[[torch.Tensor], None]
    ) -> tensor_pb2.SharedTensor | None:
        num_bytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            self._sweep()
            if target in self._abandoned:  # kept: a batch whose write_with is refused tries write
                return None  # its call ended: no one will read it
            slot = self._free_slot(num_bytes) or self._new_slot(num_bytes)
            if slot is None:
                return None
            try:
                slot.segment.link(target.name)
            except OSError as error:  # the name taken: the bytes go in the reply
                log.debug("no segment %s: %s", target.name, error)
                return None
            slot.lease, slot.expires = target, math.inf  # no sweep ends it while it is written
            stale = slot.high_water  # the previous call's rows end there
            slot.high_water = max(stale, num_bytes)  # until the tail is zeroed and the rows written
        mapping = slot.segment.mapping
        try:
            _zero(mapping, num_bytes, stale)
            fill(tensors.shared_view(mapping, shape, dtype))
            handle = tensors.seal_shared(mapping, shape, dtype, target.name, target.key, self.lease_s)
        except BaseException as error:
            # The view lives on in the traceback's frames, and an exported mapping cannot be closed.
            traceback.clear_frames(error.__traceback__)
            with self._lock:
                shared_memory.remove(self.directory, target.name)
                self._free(slot)
            raise
        with self._lock:
            slot.expires = time.monotonic() + self.lease_s  # the lease counts from the reply
            slot.high_water = num_bytes
            self.num_written += 1
            if target in self._abandoned:  # its call ended while it was written
                shared_memory.remove(self.directory, target.name)
                self._free(slot)
                return None
        return handle

    def abandon(self, target: SharedTarget) -> None:
        """The call of `target` ended before its reply was sent (its caller cancelled it): its segment
        is freed now, not when its lease runs out, or never written when the batch has not got to it
        yet. Else a caller cancelling its calls kept the pool leased, and others got bytes. A call that
        holds no segment (its name was taken: its reply went as bytes) frees none, not even one leased
        under that name to another call."""
        with self._lock:
            slot = next((slot for slot in self._slots if slot.lease is target), None)
            if slot is None or slot.expires == math.inf:  # not written yet, or being written
                self._abandoned[target] = time.monotonic()
                return
            shared_memory.remove(self.directory, target.name)
            self._free(slot)

    @property
    def num_leased(self) -> int:
        """Segments leased now: written, and not yet released by their readers nor past their lease."""
        with self._lock:
            self._sweep()
            return sum(slot.lease is not None for slot in self._slots)

    @property
    def num_segments(self) -> int:
        """Segments in the pool now, leased or free."""
        with self._lock:
            self._sweep()
            return len(self._slots)

    def close(self) -> None:
        """Stops the sweeper and removes every segment and every name leased."""
        self._stop.set()
        self._sweeper.join()
        with self._lock:
            for slot in list(self._slots):
                if slot.lease is not None:
                    shared_memory.remove(self.directory, slot.lease.name)
                self._drop(slot)

    def _free_slot(self, num_bytes: int) -> _Slot | None:
        """Under the lock: the smallest free segment that holds `num_bytes`."""
        fits = [slot for slot in self._slots if slot.lease is None and slot.segment.num_bytes >= num_bytes]
        return min(fits, key=lambda slot: slot.segment.num_bytes, default=None)

    def _new_slot(self, num_bytes: int) -> _Slot | None:
        """Under the lock: a new segment for `num_bytes`, once free ones that do not fit are given back
        to make room; None when the leased ones leave none."""
        if num_bytes > self.max_bytes:
            return None
        size = max(num_bytes, min(1 << (num_bytes - 1).bit_length(), self.max_bytes))
        free = sorted((slot for slot in self._slots if slot.lease is None), key=lambda slot: slot.last_used)
        while len(self._slots) >= self.max_segments or self._num_bytes() + size > self.max_bytes:
            if not free:
                size = num_bytes  # the rounding is a wish, not a need
                if len(self._slots) < self.max_segments and self._num_bytes() + size <= self.max_bytes:
                    break
                return None
            self._drop(free.pop(0))
        try:
            segment = shm_pool.PooledSegment.create(self.directory, size)
        except OSError as error:  # /dev/shm full: the bytes go in the reply
            log.debug("no new segment of %d bytes: %s", size, error)
            return None
        slot = _Slot(segment, last_used=time.monotonic())
        self._slots.append(slot)
        self.num_created += 1
        return slot

    def _num_bytes(self) -> int:
        return sum(slot.segment.num_bytes for slot in self._slots)

    def _free(self, slot: _Slot) -> None:
        slot.lease, slot.expires, slot.last_used = None, math.inf, time.monotonic()

    def _drop(self, slot: _Slot) -> None:
        """Under the lock: gives a segment's pages back."""
        self._slots.remove(slot)
        slot.segment.close()

    def _sweep(self) -> None:
        """Under the lock: frees what readers released, ends leases run out, gives idle segments back."""
        now = time.monotonic()
        for target, since in list(self._abandoned.items()):
            if now - since >= self.lease_s:
                del self._abandoned[target]
        for slot in list(self._slots):
            if slot.lease is None:
                if now - slot.last_used >= self.idle_s:
                    self._drop(slot)
                continue
            if slot.expires == math.inf:  # being written: its name cannot free it yet
                continue
            if now >= slot.expires:
                if shared_memory.remove(self.directory, slot.lease.name):
                    self.num_expired += 1
            elif shared_memory.exists(self.directory, slot.lease.name):
                continue
            self._free(slot)

    def _sweep_until_stopped(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with self._lock:
                self._sweep()


def _zero(mapping: mmap.mmap, start: int, stop: int) -> None:
    """Zeroes the segment's bytes [start, stop), none when stop <= start; no view of it outlives this."""
    if stop > start:
        np.frombuffer(mapping, dtype=np.uint8, count=stop - start, offset=start).fill(0)
