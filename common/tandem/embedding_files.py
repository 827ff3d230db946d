"""Embeddings on disk: what `tandem embed --out` writes and `tandem generate --part file:PATH` reads.

Two formats, picked by the file's suffix. `.safetensors` keeps the encoder's dtype (bfloat16 too)
and stores the token IDs beside the rows (`embeddings` [n, hidden_size], `token_ids` [n]). `.npy`
holds the rows alone; numpy has no bfloat16, so bfloat16 rows are written as float32 (exactly:
every bfloat16 value is a float32 value). Neither format is pickled or read with pickles allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

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


def read_embeddings(path: Path) -> torch.Tensor:
    """The rows [n, hidden_size] in `path` (a `.npy` array, or the `embeddings` tensor of a
    `.safetensors` file, or its only tensor). Raises ValueError naming the file."""
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a file")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix == ".npy":
        try:
            rows = torch.from_numpy(np.load(path, allow_pickle=False))
        except ValueError as error:
            raise ValueError(f"{path}: not a numpy array file ({error})") from None
    elif path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as tensors:
            keys = list(tensors.keys())
            key = EMBEDDINGS_KEY if EMBEDDINGS_KEY in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise ValueError(f"{path}: no {EMBEDDINGS_KEY!r} tensor among {keys}")
            rows = tensors.get_tensor(key)
    else:
        raise ValueError(f"{path}: the file name must end in {' or '.join(SUFFIXES)}")
    if rows.dim() != 2 or not rows.dtype.is_floating_point:
        raise ValueError(f"{path}: expected float rows [n, hidden_size], got {rows.dtype} {list(rows.shape)}")
    return rows if rows.dtype in FLOAT_TORCH_DTYPES else rows.float()  # float64 has no wire encoding
