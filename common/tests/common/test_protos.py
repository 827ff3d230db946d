"""The committed stubs are exactly what the protos generate, and the protos pass `buf lint`."""

import shutil
import subprocess
import sys
from pathlib import Path

from tandem.client.pb import generate


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = generate.PB_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make protos`"
    committed_stubs = set((generate.PB_ROOT / "tandem" / "v1").glob("*_pb2*.py*"))
    assert committed_stubs == {generate.PB_ROOT / p.relative_to(tmp_path) for p in fresh}


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent))
    assert buf, "buf is installed by the dev extra (buf-bin)"
    result = subprocess.run([buf, "lint"], cwd=generate.PROTO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_proto_field_has_a_comment() -> None:
    # The proto comments are the API reference: a field without one is an undocumented field.
    for proto in generate.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = (
                stripped.endswith(";")
                and "=" in stripped
                and not stripped.startswith(("option", "//", "syntax"))
            )
            if is_field:
                assert lines[i - 1].strip().startswith("//"), (
                    f"{proto.name}:{i + 1} lacks a comment: {stripped}"
                )
