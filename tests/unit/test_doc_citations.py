"""The docs' citations of tests stay true: every `path/test_x.py` a document names is a file of the repo,
and every `::test_name` beside it a test that file (or, for a bare `::name` continuing a list, some test
file) defines. A split that moved tests broke such citations before (RELIABILITY.md named a test file
not yet committed); PERFORMANCE-HISTORY.md is a record of its day and keeps the names it had."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(path for path in (ROOT / "docs").glob("*.md") if path.name != "PERFORMANCE-HISTORY.md")
DOCS.append(ROOT / "README.md")
# `services/.../test_x.py` or `test_x.py`, with `::test_name` after it (a name cut short with "..." allowed)
CITED = re.compile(r"`([\w./-]*test_\w+\.py)(?:::(\w+?)(_?\.\.\.)?)?`")
CONTINUED = re.compile(r"`::(\w+?)(_?\.\.\.)?`")


def _test_files() -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return {path: (ROOT / path).read_text() for path in listed.stdout.split() if "test" in Path(path).name}


def _defines(source: str, name: str, is_prefix: bool) -> bool:
    end = "" if is_prefix else r"\b"
    return re.search(rf"def {re.escape(name)}{end}", source) is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_cited_test_file_and_test_exists(doc: Path) -> None:
    files = _test_files()
    text = doc.read_text()
    missing = []
    for match in CITED.finditer(text):
        path, name, cut = match.groups()
        sources = [source for file, source in files.items() if file == path or file.endswith("/" + path)]
        if not sources:
            missing.append(path)
        elif name and not any(_defines(source, name, cut is not None) for source in sources):
            missing.append(f"{path}::{name}")
    for match in CONTINUED.finditer(text):
        name, cut = match.groups()
        if not any(_defines(source, name, cut is not None) for source in files.values()):
            missing.append(f"::{name}")
    assert not missing, f"{doc.name} cites tests that are not there: {missing}"
