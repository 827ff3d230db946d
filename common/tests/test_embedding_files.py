"""Embedding files: a path that is not one is refused saying what it is; a damaged or oversized one is
refused in one line (ValueError naming the file), from its header before anything is loaded."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tandem.embedding_files import read_embeddings


def test_a_directory_is_said_to_be_one(tmp_path: Path) -> None:
    """`generate --part file:/tmp` said "no such file" of a directory that exists."""
    with pytest.raises(ValueError, match="a directory, not a file"):
        read_embeddings(tmp_path)


def test_a_missing_file_is_said_to_be_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        read_embeddings(tmp_path / "rows.npy")


def _valid_safetensors(path: Path) -> bytes:
    save_file({"embeddings": torch.zeros(3, 8)}, str(path))
    return path.read_bytes()


def _header_only_safetensors(header: dict[str, Any]) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    "damage",
    [
        lambda valid: b"",
        lambda valid: valid[:4],
        lambda valid: valid[: len(valid) // 2],
        lambda valid: b"not a tensor file at all, just text\n" * 4,
        lambda valid: struct.pack("<Q", 2**62) + valid[8:],
        lambda valid: _header_only_safetensors(
            {"embeddings": {"dtype": "F32", "shape": [10**6, 576], "data_offsets": [0, 4 * 576 * 10**6]}}
        ),
        lambda valid: _header_only_safetensors({"embeddings": 5}),
    ],
    ids=["empty", "4 bytes", "half", "text", "header length 2^62", "shape over the data", "broken header"],
)
def test_a_damaged_safetensors_file_is_one_line(damage: Any, tmp_path: Path) -> None:
    """Each was a 50-line SafetensorError traceback out of `generate --part file:`."""
    rows = tmp_path / "rows.safetensors"
    rows.write_bytes(damage(_valid_safetensors(tmp_path / "valid.safetensors")))
    with pytest.raises(ValueError, match=rf"^{rows}: not a safetensors file \(.+\)$"):
        read_embeddings(rows)


def _npy_header(path: Path, descr: str, shape: tuple[int, ...], data: bytes = b"") -> Path:
    with path.open("wb") as file:
        np.lib.format.write_array_header_1_0(file, {"descr": descr, "fortran_order": False, "shape": shape})
        file.write(data)
    return path


@pytest.mark.parametrize("dtype", ["datetime64[s]", "V4", "U5", "longdouble", [("a", "<f4")]])
def test_rows_of_a_type_torch_cannot_take_are_refused_by_their_header(dtype: Any, tmp_path: Path) -> None:
    """torch.from_numpy raised TypeError (a traceback) for these; only ValueError was caught."""
    rows = tmp_path / "rows.npy"
    np.save(rows, np.zeros((3, 8), dtype=dtype), allow_pickle=False)
    with pytest.raises(
        ValueError, match=rf"^{rows}: expected float rows \[n, hidden_size\], got .+ \[3, 8\]$"
    ):
        read_embeddings(rows)


@pytest.mark.parametrize("num_rows", [10**11, 10**23])
def test_a_header_claiming_more_rows_than_a_call_carries_is_refused_unloaded(
    num_rows: int, tmp_path: Path
) -> None:
    """numpy tried to allocate 210 TiB for (1e11, 576) and raised OverflowError for (1e23, 576)."""
    rows = _npy_header(tmp_path / "rows.npy", "<f4", (num_rows, 576))
    with pytest.raises(
        ValueError, match=rf"^{rows}: rows \[{num_rows}, 576\] take [\d,]+ bytes, over the 67,108,864 "
    ):
        read_embeddings(rows)


def test_rows_over_the_bound_as_sent_are_refused(tmp_path: Path) -> None:
    """float64 goes as float32: 4 bytes a value count, not 8."""
    rows = tmp_path / "rows.npy"
    np.save(rows, np.zeros((4, 8), dtype=np.float64), allow_pickle=False)
    assert read_embeddings(rows, max_bytes=4 * 8 * 4).shape == (4, 8)
    with pytest.raises(ValueError, match=r"rows \[4, 8\] take 128 bytes, over the 127 one call"):
        read_embeddings(rows, max_bytes=127)


def test_float8_rows_are_counted_as_the_float32_they_are_sent_as(tmp_path: Path) -> None:
    rows = tmp_path / "rows.safetensors"
    save_file({"embeddings": torch.zeros(4, 8).to(torch.float8_e4m3fn)}, rows)
    assert read_embeddings(rows, max_bytes=4 * 8 * 4).dtype == torch.float32
    with pytest.raises(ValueError, match=r"rows \[4, 8\] take 128 bytes, over the 127 one call"):
        read_embeddings(rows, max_bytes=127)


def test_a_header_claiming_more_data_than_the_file_holds_is_refused_unloaded(tmp_path: Path) -> None:
    rows = _npy_header(tmp_path / "rows.npy", "<f4", (1000, 8), data=bytes(16))
    with pytest.raises(
        ValueError, match=r"not a numpy array file \(its header says 32,000 bytes of data, it holds 16\)"
    ):
        read_embeddings(rows)


def test_an_empty_npy_file_is_not_a_numpy_array_file(tmp_path: Path) -> None:
    """np.load's EOFError became click's Abort: exit 130 with a blank line, as if Ctrl-C."""
    rows = tmp_path / "rows.npy"
    rows.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^{rows}: not a numpy array file \(EOF"):
        read_embeddings(rows)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_path_that_is_not_a_regular_file_is_said_so(kind: str, tmp_path: Path) -> None:
    """A FIFO (no writer: it is refused, not waited on) and /dev/null were said to be "no such file"."""
    rows = tmp_path / "rows.npy"
    if kind == "fifo":
        os.mkfifo(rows)
    else:
        rows.symlink_to("/dev/null")
    with pytest.raises(ValueError, match=rf"^{rows}: not a regular file$"):
        read_embeddings(rows)
