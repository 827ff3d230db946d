"""Embedding files: a path that is not one is refused saying what it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.embedding_files import read_embeddings


def test_a_directory_is_said_to_be_one(tmp_path: Path) -> None:
    """`generate --part file:/tmp` said "no such file" of a directory that exists."""
    with pytest.raises(ValueError, match="a directory, not a file"):
        read_embeddings(tmp_path)


def test_a_missing_file_is_said_to_be_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        read_embeddings(tmp_path / "rows.npy")
