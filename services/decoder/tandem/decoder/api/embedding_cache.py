"""The rows of recent encoder inputs, so a picture sent twice is encoded once (vLLM's `mm_hash` cache).

Keyed by the encoder's model and a BLAKE2b-256 digest of the input (its kind and content): a
collision would hand one caller's rows to another, so the key is a cryptographic digest, never a
checksum. Bounded in bytes, least recently used out first. A row tensor is never written after it is
fetched (requests only read it), so an entry and the requests using it share it. Used from the event
loop only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch


def cache_key(model: str, kind: str, content: str | Sequence[int] | bytes, dtype: torch.dtype) -> bytes:
    """The digest of an input as the encoder embeds it, for `model`, in `dtype`."""
    digest = hashlib.blake2b(digest_size=32)
    for label in (model, kind, str(dtype)):
        encoded = label.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded)  # no two label lists read alike
    if isinstance(content, str):
        digest.update(content.encode())
    elif isinstance(content, bytes):
        digest.update(content)
    else:
        digest.update(np.asarray(content, dtype="<u4").tobytes())
    return digest.digest()


class EmbeddingCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # 0: nothing is kept
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.num_bytes = 0
        self.num_hits = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        rows = self._entries.get(key)
        if rows is not None:
            self._entries.move_to_end(key)
            self.num_hits += 1
        return rows

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        """Keeps `rows` ([n, hidden_size]) unless they alone exceed the bound; evicts the oldest."""
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.num_bytes + size > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.num_bytes -= oldest.numel() * oldest.element_size()
        self._entries[key] = rows
        self.num_bytes += size

    def __len__(self) -> int:
        return len(self._entries)
