"""Regenerate the Python stubs in common/tandem/client/pb from protos/ (`make protos`).

protoc writes `from tandem.v1 import tensor_pb2`, which only resolves with tandem/client/pb on sys.path;
the stubs are rewritten to absolute `tandem.client.pb.tandem.v1` imports so they work as a normal package.
`generate(out_dir)` is also what the drift test calls, so the committed stubs and a fresh run are
produced by exactly the same code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[4]  # common/tandem/client/pb/generate.py
PROTO_ROOT = REPO_ROOT / "protos"
PB_ROOT = Path(__file__).resolve().parent
_IMPORT = re.compile(r"^from tandem\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("tandem/v1/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py(i)` under out_dir/tandem/v1."""
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(protoc.__file__).parent / "_proto"
    # mypy-protobuf's plugins sit beside the interpreter; a venv that is not activated is not on PATH.
    bin_dir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its output above")
    written = sorted((out_dir / "tandem" / "v1").glob("*_pb2*.py*"))
    for path in written:
        path.write_text(_IMPORT.sub("from . import ", path.read_text()))
    for package in (out_dir / "tandem", out_dir / "tandem" / "v1"):
        (package / "__init__.py").touch()
    return written


if __name__ == "__main__":
    for written_path in generate(PB_ROOT):
        print(written_path.relative_to(REPO_ROOT))
    sys.exit(0)
