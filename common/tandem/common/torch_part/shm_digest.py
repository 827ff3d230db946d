"""The keyed digest of a shared-memory segment's bytes (`shared_memory.py`'s protocol): the writer's over
the segment as written, the reader's over its own copy.

NOTE: the digest is AES-256-GMAC (GCM with nothing to encrypt: its tag over the rows as associated data)
under the call's key, with a fixed nonce: each key is drawn for one call and tags one message, the rows
the writer wrote; the reader recomputes it over its own copy and keeps its result to itself. Without the
key a tag cannot be predicted, and two different byte strings of L 16-byte blocks share a tag under a
random key with probability at most about L / 2^128. It runs from the `cryptography` wheel's OpenSSL at
GHASH speed on carry-less multiplication (PCLMULQDQ, VPCLMULQDQ and VAES on the Zen 4 machine measured: 23
GB/s, against 12.8 for Poly1305, 7.4 for the numpy universal hash it replaced, 1.8 for HMAC-SHA256 and 0.9
for keyed BLAKE2b; docs/PERFORMANCE.md). Both sides read every byte under the call's key: the writer in a
pass of its own over the segment; the reader, where its CPU has PCLMULQDQ, in the same pass as its copy
(the decoder's `copy_digest` kernel computes GHASH in C from the bytes it copies, with H and E_K(J0) from
OpenSSL: the same tag bit for bit), elsewhere in a second pass over its copy (`copy_then_digest`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32  # a digest key
DIGEST_BYTES = 16  # a GCM tag
DIGEST_NONCE = bytes(12)  # fixed: a key tags one message (the note)
DIGEST_UPDATE_BYTES = 1 << 30  # fed to the MAC in parts of at most this: its one call takes < 2^31

# How a reader copies a segment's bytes and digests them: (source [n] uint8 read-only, out [n] uint8,
# key) -> keyed_digest of the bytes written to `out`. `copy_then_digest` is two passes; the decoder
# passes its fused kernel where its CPU has one (tandem.decoder.backends.cpu.copy_digest).
CopyDigest = Callable[[np.ndarray, np.ndarray, bytes], bytes]


def keyed_digest(data: memoryview | bytes | np.ndarray, key: bytes) -> bytes:
    """DIGEST_BYTES of `data` under `key` (KEY_BYTES): AES-256-GMAC, see the module's note."""
    assert len(key) == KEY_BYTES
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    context = Cipher(algorithms.AES(key), modes.GCM(DIGEST_NONCE)).encryptor()
    for start in range(0, len(view), DIGEST_UPDATE_BYTES):
        context.authenticate_additional_data(view[start : start + DIGEST_UPDATE_BYTES])
    context.finalize()
    return context.tag


def copy_then_digest(source: np.ndarray, out: np.ndarray, key: bytes) -> bytes:
    """The CopyDigest of any CPU: numpy's copy, then keyed_digest over the copy (two passes)."""
    np.copyto(out, source)
    return keyed_digest(out, key)
