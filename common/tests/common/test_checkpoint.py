"""Reading a checkpoint's JSON files: each failure is one error naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common import checkpoint
from tandem.common.checkpoint import read_json


class Refused(ValueError):
    pass


def test_a_json_object_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert read_json(tmp_path / "config.json", Refused) == {"hidden_size": 64}


def test_a_file_larger_than_the_limit_is_refused_from_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsed, a 600 MB config.json took 1.5 GB before anything looked at it."""
    monkeypatch.setattr(checkpoint, "MAX_JSON_BYTES", 1000)
    path = tmp_path / "config.json"
    path.write_text('{"junk": "' + "x" * 1000 + '"}')
    with pytest.raises(Refused, match=rf"^{path} has 1,012 bytes, more than the 1,000 a JSON file"):
        read_json(path, Refused)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nests too deeply to read"),
        ("[1]", "must hold a JSON object, got list"),
    ],
)
def test_a_malformed_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(Refused, match=rf"^{path} {message}"):
        read_json(path, Refused)


def test_a_file_that_cannot_be_read_is_named_with_the_systems_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unreadable config.json (EACCES) let PermissionError through: a traceback at the encoder's
    start, exit 1. Simulated: root reads a file whatever its mode."""
    path = tmp_path / "config.json"
    path.write_text("{}")

    def refused(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refused)
    with pytest.raises(Refused, match=rf"^cannot read {path}: Permission denied$"):
        read_json(path, Refused)
