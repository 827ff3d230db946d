"""Installing from a package index in a test: a failure because the index cannot be reached skips the
test, saying so; any other failure (a broken package, a bad lock file) fails it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

# What npm and pip print when the network, not the package, is at fault.
UNREACHABLE = (
    "ENOTFOUND",
    "EAI_AGAIN",
    "ECONNREFUSED",
    "ECONNRESET",
    "ETIMEDOUT",
    "ENETUNREACH",
    "EHOSTUNREACH",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Max retries exceeded",
)


def install(argv: list[str], cwd: Path | None = None, timeout_s: float = 180) -> None:
    """Runs `argv` (an `npm install`, a `pip install`); skips when the index is out of reach."""
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode == 0:
        return
    output = result.stdout + result.stderr
    reason = next((word for word in UNREACHABLE if word in output), None)
    if reason is not None:
        pytest.skip(f"{argv[0]} could not reach its package index ({reason}): offline?")
    pytest.fail(f"{' '.join(argv)} failed (exit {result.returncode}):\n{output[-2000:]}")
