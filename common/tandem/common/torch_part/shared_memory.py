"""Shared-memory segments between an encoder and a decoder on one host: the protocol, and the names and
files all its parts share. Its parts, each in a module of its own: the proof of sharing a host
(`shm_probe.py`), the writer's pool segments (`shm_pool.py`), the reader's mappings of them
(`shm_segment_maps.py`), the locks that tell a live process's files from a dead one's
(`shm_locks.py`), and the keyed digest of a segment's bytes (`shm_digest.py`). Files and bytes only:
rows become tensors in `tensors.py`.

NOTE: the protocol. The decoder (the reader) creates a probe file in its /dev/shm, `tandem-probe-<32
hex>`, mode 0600, holding 32 random bytes, and sends its name and content with every Embed call, with
a fresh segment name `tandem-rows-<32 hex>` and a fresh 32-byte digest key (`SharedMemoryOffer`). The
encoder (the writer) takes the offer only if the file of that name in its own /dev/shm is a regular
file of its own user holding exactly those bytes: both then see one /dev/shm (one host, one IPC
namespace) as one user. It keeps a pool of segments, `tandem-pool-<32 hex>`, created once, their pages
allocated and kept mapped (a fresh tmpfs page costs 20-40 times its copy: docs/PERFORMANCE.md); for a
call it links a free one under the name asked for (a second name for the same file, O_EXCL-like:
never over a file already there), writes the rows (its embedder straight into the mapping where it
can, else a copy), and replies with a handle (`SharedTensor`) carrying their keyed digest, computed
over the segment as written: nothing else writes a leased segment but the user both run as. The
reader opens only the name it asked for, checks the handle against the file, copies the bytes into
its own memory (through its mapping of the file, kept for the next call given the same pool segment:
`SegmentMaps`) and checks the digest of that copy under its own key (the copy and the digest are one
pass where the reader has a fused `CopyDigest`: the decoder's C kernel), then removes the name: that
releases the segment to the writer's pool, and a handle replayed later finds nothing. One pointing
anywhere else is refused before anything is opened. The writer removes the name of a segment no
reader released after its lease, and only then writes into it again: a reader that comes later still
finds the name gone, and one that outlived the lease while reading sees its digest fail, never other
rows.

Who can reach a segment: only the user both services run as (mode 0600 under /dev/shm, a sticky
directory), and only by its name, 128 random bits that travel in the Embed call and its reply. That
user can read or change a segment, as it can read or change either process's memory: the digest
detects a segment changed or swapped after it was written, by a bug or a stale file, and ties the
handle to this call's key, but it is no defence against that user.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import sys
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PROBE_PREFIX = "tandem-probe-"
SEGMENT_PREFIX = "tandem-rows-"  # a call's name for a segment: the reader's choice
POOL_PREFIX = "tandem-pool-"  # the writer's own name for a segment of its pool
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the page tables filled when mapped
_NAME = re.compile(r"(tandem-probe-|tandem-rows-|tandem-pool-)[0-9a-f]{32}")


def new_name(prefix: str) -> str:
    """A fresh name under `prefix`: 128 random bits, in hex."""
    return prefix + secrets.token_hex(16)


def is_name(name: str, prefix: str) -> bool:
    """`name` is `prefix` and 32 lowercase hex digits: nothing else is ever opened or created."""
    return name.startswith(prefix) and _NAME.fullmatch(name) is not None


def is_supported(directory: Path = SHM_DIR) -> bool:
    """Segments hold little-endian rows as they lie in memory: a little-endian host with the directory."""
    return sys.byteorder == "little" and directory.is_dir()


def remove(directory: Path, name: str) -> bool:
    """Removes the file `name`; False when it was gone already."""
    try:
        os.unlink(directory / name)
    except FileNotFoundError:
        return False
    return True


def exists(directory: Path, name: str) -> bool:
    return os.path.lexists(directory / name)
