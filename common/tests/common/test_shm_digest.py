"""The keyed digest of a segment's bytes is AES-256-GMAC: against its specification worked in plain
integers, a published tag and the library's own one-shot, and it changes with any bit, the length and
the key."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tandem.common.torch_part import shm_digest


def _gf_multiply(x: int, y: int) -> int:
    """x * y in GCM's GF(2^128), on blocks read as big-endian integers (bit 0 of a block is its top
    bit: SP 800-38D's algorithm 1, shifting right and reducing by R = 0xe1 << 120)."""
    product, v = 0, y
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            product ^= v
        v = (v >> 1) ^ (0xE1 << 120) if v & 1 else v >> 1
    return product


def _reference_gmac(data: bytes, key: bytes) -> bytes:
    """GMAC by SP 800-38D in plain Python integers, AES's block function the only borrowed part:
    H = E(0^128), GHASH over the data zero-padded to blocks and its length block, masked by E(J0)."""
    block = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    h = int.from_bytes(block.update(bytes(16)), "big")
    j0 = shm_digest.DIGEST_NONCE + (1).to_bytes(4, "big")
    padded = data + bytes(-len(data) % 16)
    lengths = (8 * len(data)).to_bytes(8, "big") + (0).to_bytes(8, "big")  # of the data, of no text
    ghash = 0
    for i in range(0, len(padded + lengths), 16):
        ghash = _gf_multiply(ghash ^ int.from_bytes((padded + lengths)[i : i + 16], "big"), h)
    return (ghash ^ int.from_bytes(block.update(j0), "big")).to_bytes(16, "big")


@pytest.mark.parametrize("num_bytes", [0, 1, 15, 16, 17, 100, 1000])
def test_the_digest_is_gmac_by_its_specification(num_bytes: int) -> None:
    data, key = os.urandom(num_bytes), os.urandom(shm_digest.KEY_BYTES)
    assert shm_digest.keyed_digest(data, key) == _reference_gmac(data, key)


def test_the_digest_of_nothing_under_the_zero_key_is_the_published_gcm_tag() -> None:
    # McGrew and Viega's GCM test case 13: AES-256, K = 0, IV = 0, no text, no associated data.
    assert shm_digest.keyed_digest(b"", bytes(32)).hex() == "530f8afbc74536b9a963b4f1c4cb738b"


@pytest.mark.parametrize("num_bytes", [1, 4096, 576 * 64 * 2 + 3])
def test_the_digest_is_the_librarys_one_shot_gmac_fed_in_parts_or_whole(
    num_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, key = os.urandom(num_bytes), os.urandom(shm_digest.KEY_BYTES)
    one_shot = AESGCM(key).encrypt(shm_digest.DIGEST_NONCE, b"", data)  # no text: the tag alone
    assert shm_digest.keyed_digest(data, key) == one_shot
    monkeypatch.setattr(shm_digest, "DIGEST_UPDATE_BYTES", 1000)  # what a > 1 GiB segment does, in small
    assert shm_digest.keyed_digest(memoryview(data), key) == one_shot


def test_the_digest_changes_with_any_bit_the_length_and_the_key() -> None:
    data, key = bytearray(os.urandom(3 * 16384)), os.urandom(shm_digest.KEY_BYTES)
    digest = shm_digest.keyed_digest(bytes(data), key)
    assert len(digest) == shm_digest.DIGEST_BYTES
    assert shm_digest.keyed_digest(bytes(data), os.urandom(shm_digest.KEY_BYTES)) != digest
    for position in (0, 5, 16384 + 3, len(data) - 1):
        altered = bytearray(data)
        altered[position] ^= 0x80  # a sign bit of a float
        assert shm_digest.keyed_digest(bytes(altered), key) != digest, position
    both = bytearray(data)  # two bits flipped at once
    both[3] ^= 0x80
    both[7] ^= 0x80
    assert shm_digest.keyed_digest(bytes(both), key) != digest
    assert shm_digest.keyed_digest(bytes(data) + b"\0", key) != digest  # the length counts, zeros too
