"""The decoder's read of a shared-memory segment as one pass: the copy and its AES-256-GMAC digest
fused in C (csrc/copy_digest.c), equal bit for bit to `shm_digest.keyed_digest` of the copy.

NOTE: the split. GMAC's tag is GHASH_H(data, lengths) XOR E_K(J0): the two AES blocks, H = E_K(0^128)
and E_K(J0) for the fixed nonce, are computed here with OpenSSL (one ECB call per read, so no AES is
written in C), and the C kernel does the GHASH over every byte while it copies them, from the same
loaded registers: the digest covers exactly the bytes copied. It needs PCLMULQDQ (and VPCLMULQDQ with
AVX-512BW for its 512-bit form); elsewhere, and without the kernels, the reader keeps
`shm_digest.copy_then_digest` (numpy's copy, then OpenSSL's GMAC over it).
"""

from __future__ import annotations

import ctypes

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from tandem.common.torch_part import shm_digest
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernels import Kernels, load_for_cpu

NARROW_FLAGS = frozenset({"pclmulqdq", "ssse3", "sse4_1"})  # /proc/cpuinfo: the 128-bit form
WIDE_FLAGS = NARROW_FLAGS | {"vpclmulqdq", "avx512f", "avx512bw"}  # and the 512-bit form
# J0 for a 96-bit nonce: the nonce, then the 32-bit block counter 1.
_J0 = shm_digest.DIGEST_NONCE + (1).to_bytes(4, "big")


class FusedCopyDigest:
    """A `shm_digest.CopyDigest` on the C kernel: one pass over the source."""

    def __init__(self, kernels: Kernels, is_wide: bool) -> None:
        self.kernels = kernels
        self.is_wide = is_wide  # the VPCLMULQDQ form (4 blocks a register)

    def __call__(self, source: np.ndarray, out: np.ndarray, key: bytes) -> bytes:
        """Copies `source` ([n] uint8) into `out` ([n] uint8, writable, not overlapping it) and returns
        keyed_digest(out, key)."""
        if len(key) != shm_digest.KEY_BYTES:
            raise ValueError(f"key must be {shm_digest.KEY_BYTES} bytes, got {len(key)}")
        for name, array in (("source", source), ("out", out)):
            if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
                raise ValueError(
                    f"{name} must be a contiguous 1-D uint8 array, got {array.dtype} {array.shape}"
                )
        if len(out) != len(source):
            raise ValueError(f"out must hold the source's {len(source)} bytes, got {len(out)}")
        if not out.flags.writeable:
            raise ValueError("out must be writable")
        blocks = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(bytes(16) + _J0)  # H, E_K(J0)
        tag = ctypes.create_string_buffer(shm_digest.DIGEST_BYTES)
        status = self.kernels.copy_ghash(
            out.ctypes.data, source.ctypes.data, len(source), blocks[:16], blocks[16:], ctypes.addressof(tag),
            int(self.is_wide),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(
                f"copy_ghash refused {len(source)} bytes (status {status}): this CPU lacks its ISA"
            )
        return tag.raw


def for_cpu(cpu: CpuInfo | None = None, kernels: Kernels | None = None) -> shm_digest.CopyDigest:
    """The fused kernel where this CPU has carry-less multiplication and the kernels are built, else
    `shm_digest.copy_then_digest`."""
    cpu = cpu or this_cpu()
    if not NARROW_FLAGS <= cpu.flags:
        return shm_digest.copy_then_digest
    kernels = kernels or load_for_cpu()
    if kernels is None:
        return shm_digest.copy_then_digest
    return FusedCopyDigest(kernels, is_wide=WIDE_FLAGS <= cpu.flags)
