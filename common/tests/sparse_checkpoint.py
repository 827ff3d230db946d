"""A safetensors file whose last tensor is a hole in a sparse file: a token table of hundreds of MiB
written at once and taking no disk, which a service still reads (and casts, and rounds) in full, so
its load takes seconds. The stopping tests of both services signal a process during such a load."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_sparse_table(
    path: Path, weights: dict[str, torch.Tensor], table_name: str, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """`weights` as they are, then `table_name` of `shape` and `dtype`, all zeros, left unwritten."""
    entries: dict[str, dict] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, tensor in [*weights.items(), (table_name, None)]:
        num_bytes = shape[0] * shape[1] * dtype.itemsize if tensor is None else tensor.nbytes
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype if tensor is None else tensor.dtype],
            "shape": list(shape if tensor is None else tensor.shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        if tensor is not None:
            blobs.append(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        offset += num_bytes
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"".join(blobs))
        f.truncate(8 + len(header) + offset)
