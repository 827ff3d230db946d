"""Where the code lives: the folders that each hold a part of the `tandem` namespace package.

pyproject.toml's package finder lists them, so the tests that read the source walk the same folders
the install does.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_FIND = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
# common/, services/encoder/, services/decoder/, services/gateway/: each holds a tandem/ folder.
SOURCE_ROOTS: tuple[Path, ...] = tuple(REPO_ROOT / where for where in _FIND["where"])


# The units, each a folder with its own pyproject.toml that installs and tests alone: its own tests are
# in its tests/ folder (`pytest services/gateway`); the repository's tests/ holds the cross-service ones.
UNITS: tuple[str, ...] = tuple(root.relative_to(REPO_ROOT).as_posix() for root in SOURCE_ROOTS)


def package_dir(name: str) -> Path:
    """The one folder holding the dotted package `name` (`tandem.decoder.engine`), whichever root has it."""
    relative = Path(*name.split("."))
    found = [root / relative for root in SOURCE_ROOTS if (root / relative).is_dir()]
    if len(found) != 1:
        raise LookupError(f"{name}: found in {len(found)} source roots, expected exactly 1")
    return found[0]


def python_files() -> dict[str, Path]:
    """Every module of the `tandem` namespace, by dotted name (a package by its own name)."""
    found = {}
    for root in SOURCE_ROOTS:
        for path in (root / "tandem").rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found
