"""Embeddings on disk: what `tandem embed --out` writes and `tandem generate --part file:PATH` reads.

Two formats, picked by the file's suffix. `.safetensors` keeps the encoder's dtype (bfloat16 too)
and stores the token IDs beside the rows (`embeddings` [n, hidden_size], `token_ids` [n]). `.npy`
holds the rows alone; numpy has no bfloat16, so bfloat16 rows are written as float32 (exactly:
every bfloat16 value is a float32 value). Neither format is pickled or read with pickles allowed.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tandem.client.channel import DEFAULT_MAX_MESSAGE_BYTES
from tandem.common.torch_part.torch_dtypes import FLOAT_TORCH_DTYPES

SUFFIXES = (".npy", ".safetensors")
EMBEDDINGS_KEY = "embeddings"
TOKEN_IDS_KEY = "token_ids"


def write_embeddings(path: Path, embeddings: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """Writes `embeddings` [n, hidden_size] to `path`; returns what the file holds. Raises ValueError."""
    if path.suffix == ".npy":
        stored = embeddings.float() if embeddings.dtype == torch.bfloat16 else embeddings
        np.save(path, stored.numpy(), allow_pickle=False)
        return stored
    if path.suffix == ".safetensors":
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        save_file({EMBEDDINGS_KEY: embeddings.contiguous(), TOKEN_IDS_KEY: ids}, str(path))
        return embeddings
    raise ValueError(f"{path}: the file name must end in {' or '.join(SUFFIXES)}")


def read_embeddings(path: Path, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> torch.Tensor:
    """The rows [n, hidden_size] in `path` (a `.npy` array, or the `embeddings` tensor of a
    `.safetensors` file, or its only tensor), at most `max_bytes` as sent (the client channel's cap:
    more cannot go in one call). Raises ValueError naming the file.

    Shape and dtype are checked from the file's header against its size and the bound before anything
    is loaded: a header claiming (1e11, 576) rows made numpy allocate 210 TiB, and a safetensors error
    was a 50-line traceback."""
    try:
        # O_NONBLOCK: a FIFO would otherwise wait for a writer before fstat could refuse it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a directory, not a file") from None
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or path.suffix not in SUFFIXES:  # before fdopen, which refuses a dir
        os.close(fd)
        if stat.S_ISDIR(status.st_mode):
            raise ValueError(f"{path}: a directory, not a file")
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{path}: not a regular file")
        raise ValueError(f"{path}: the file name must end in {' or '.join(SUFFIXES)}")
    with os.fdopen(fd, "rb") as file:
        if path.suffix == ".npy":
            rows = _read_npy(path, file, status.st_size, max_bytes)
        else:
            rows = _read_safetensors(path, max_bytes)
    if rows.dim() != 2 or not rows.dtype.is_floating_point:
        raise ValueError(f"{path}: expected float rows [n, hidden_size], got {rows.dtype} {list(rows.shape)}")
    return rows if rows.dtype in FLOAT_TORCH_DTYPES else rows.float()  # float64 has no wire encoding


def _sent_bytes(num_values: int, itemsize: int) -> int:
    """What `num_values` values of `itemsize` bytes take as sent: 2-byte floats go as they are, every
    other float as float32 (float64 narrowed, the 1-byte float8 kinds widened: counted at 1 byte, a
    float8 file four times over the bound passed the check and failed the call, unnamed)."""
    return num_values * (2 if itemsize == 2 else 4)


def _check_rows(path: Path, shape: Sequence[int], dtype: str, itemsize: int, max_bytes: int) -> None:
    if len(shape) != 2:
        raise ValueError(f"{path}: expected float rows [n, hidden_size], got {dtype} {list(shape)}")
    if (sent := _sent_bytes(math.prod(shape), itemsize)) > max_bytes:
        raise ValueError(
            f"{path}: rows {list(shape)} take {sent:,} bytes, over the {max_bytes:,} one call to the decoder "
            "carries"
        )


def _read_npy(path: Path, file: BinaryIO, size: int, max_bytes: int) -> torch.Tensor:
    try:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(file)
        else:  # 3.0 is written only for structured arrays, which hold no float rows
            raise ValueError(f"format version {version[0]}.{version[1]} is not read here")
    except ValueError as error:
        raise ValueError(f"{path}: not a numpy array file ({error})") from None
    # Floats numpy and torch share: float16, float32, float64 (not longdouble, of 12 or 16 bytes).
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8):
        raise ValueError(f"{path}: expected float rows [n, hidden_size], got {dtype} {list(shape)}")
    _check_rows(path, shape, str(dtype), dtype.itemsize, max_bytes)
    if (needed := math.prod(shape) * dtype.itemsize) > size - file.tell():
        raise ValueError(
            f"{path}: not a numpy array file (its header says {needed:,} bytes of data, it holds "
            f"{size - file.tell():,})"
        )
    file.seek(0)
    try:
        return torch.from_numpy(np.load(file, allow_pickle=False))
    except ValueError as error:
        raise ValueError(f"{path}: not a numpy array file ({error})") from None


def _read_safetensors(path: Path, max_bytes: int) -> torch.Tensor:
    # safe_open checks the header against the file (mapped, not read): a header length of 2^62, a shape
    # bigger than the data, a broken header are its SafetensorError, refused here in one line.
    try:
        with safe_open(str(path), framework="pt") as tensors:
            keys = list(tensors.keys())
            key = EMBEDDINGS_KEY if EMBEDDINGS_KEY in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise ValueError(f"{path}: no {EMBEDDINGS_KEY!r} tensor among {keys}")
            tensor = tensors.get_slice(key)
            shape, dtype = tensor.get_shape(), tensor.get_dtype()
            if len(shape) == 2:
                _check_rows(path, shape, dtype, _SAFETENSORS_ITEMSIZE.get(dtype, 8), max_bytes)
            return tensors.get_tensor(key)
    except SafetensorError as error:
        raise ValueError(f"{path}: not a safetensors file ({error})") from None


# Bytes per value of the safetensors dtypes rows may be in (others, 8 as an upper bound, are refused
# after loading as not float rows, or sent as float32).
_SAFETENSORS_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}
