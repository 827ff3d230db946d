"""The encoder's shared-memory segments: an Embed reply's rows for a caller on this host.

A call whose `shared_memory` offer proves it shares this host's /dev/shm and user
(`tandem/common/shared_memory.py`) gets a `SharedTarget`; its batch writes the rows into the segment
the offer named and answers with the handle instead of the bytes. Segments are bounded in number and
bytes: when either bound is reached, or the name is taken, the reply carries bytes as usual, so
sharing never fails a call. A segment is gone once its reader has removed it (the sweep then frees
its share of the bounds) or, unread, once its lease has run out: a reply lost with its cancelled call
leaves nothing behind for longer than the lease. A thread of its own sweeps, every quarter lease.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common import shared_memory, tensors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedTarget:
    """Where one call's rows go: the segment its offer named, digested under its key."""

    segments: SharedSegments
    name: str  # "tandem-rows-<32 hex>", the offer's
    key: bytes  # [KEY_BYTES] the offer's digest key

    def write(self, rows: torch.Tensor, dtype: torch.dtype | None) -> tensor_pb2.SharedTensor | None:
        """The handle of `rows` (cast to `dtype`) written into the segment; None: send bytes instead."""
        return self.segments.write(self, rows, dtype)


@dataclass
class _Live:
    num_bytes: int
    expires: float  # time.monotonic()


class SharedSegments:
    def __init__(self, directory: Path, max_bytes: int, max_segments: int, lease_s: float) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self.lease_s = lease_s
        self._live: dict[str, _Live] = {}  # segments written and not yet seen gone
        self._num_bytes = 0
        self._lock = threading.Lock()  # the worker thread writes, the sweeper sweeps
        self.num_written = 0  # replies sent as segments (tests, the benchmark)
        self.num_expired = 0  # segments removed unread at the end of their lease
        self._stop = threading.Event()
        self._sweeper = threading.Thread(
            target=self._sweep_until_stopped, name="encoder-segments", daemon=True
        )
        self._sweeper.start()

    def target(self, offer: encoder_pb2.SharedMemoryOffer) -> SharedTarget | None:
        """The offer's target when its proof holds; None (bytes in the reply) otherwise."""
        if not shared_memory.is_name(offer.segment_name, shared_memory.SEGMENT_PREFIX):
            return None
        if len(offer.digest_key) != shared_memory.KEY_BYTES:
            return None
        if not shared_memory.probe_matches(self.directory, offer.probe_name, offer.probe_token):
            return None
        return SharedTarget(self, offer.segment_name, offer.digest_key)

    def write(
        self, target: SharedTarget, rows: torch.Tensor, dtype: torch.dtype | None
    ) -> tensor_pb2.SharedTensor | None:
        num_bytes = tensors.shared_num_bytes(rows, dtype)
        with self._lock:
            self._sweep()
            if len(self._live) >= self.max_segments or self._num_bytes + num_bytes > self.max_bytes:
                return None
            try:
                segment = shared_memory.create_segment(self.directory, target.name, num_bytes)
            except OSError as error:  # the name taken, /dev/shm full: the bytes go in the reply
                log.debug("no segment %s: %s", target.name, error)
                return None
            # Counted from now: should the write fail, the sweep still removes the file.
            self._live[target.name] = _Live(num_bytes, time.monotonic() + self.lease_s)
            self._num_bytes += num_bytes
        try:
            handle = tensors.encode_shared(rows, segment, target.name, target.key, self.lease_s, dtype)
        except BaseException:
            segment.close()
            self._forget(target.name, remove=True)
            raise
        segment.close()
        self.num_written += 1
        return handle

    @property
    def num_live(self) -> int:
        """Segments written and still there, unread, now."""
        with self._lock:
            self._sweep()
            return len(self._live)

    def close(self) -> None:
        """Stops the sweeper and removes every segment still there."""
        self._stop.set()
        self._sweeper.join()
        with self._lock:
            for name in self._live:
                shared_memory.remove(self.directory, name)
            self._live.clear()
            self._num_bytes = 0

    def _forget(self, name: str, remove: bool) -> None:
        with self._lock:
            live = self._live.pop(name, None)
            if live is not None:
                self._num_bytes -= live.num_bytes
        if remove:
            shared_memory.remove(self.directory, name)

    def _sweep(self) -> None:
        """Under the lock: frees what readers took, removes what outlived its lease."""
        now = time.monotonic()
        for name, live in list(self._live.items()):
            if now >= live.expires:
                if shared_memory.remove(self.directory, name):
                    self.num_expired += 1
            elif shared_memory.exists(self.directory, name):
                continue
            del self._live[name]
            self._num_bytes -= live.num_bytes

    def _sweep_until_stopped(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with self._lock:
                self._sweep()
