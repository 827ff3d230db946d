"""Installing from a package index in a test: a failure because the index cannot be reached skips the
test, saying so; any other failure (a broken package, a bad lock file) fails it."""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import tempfile
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


def npm_ci(package_dir: Path) -> None:
    """`npm ci` in `package_dir`, once for its lock file, whichever worker asks first. `npm ci` starts by
    deleting node_modules: three tests (test_node_client, test_docs_examples, vision test_commands) on
    two workers each ran it in clients/node, and one's delete met the other's install (npm's ENOTEMPTY
    on node_modules/@grpc/grpc-js/..., exit 217: 12 Node tests errored in a clean-clone run), or could
    delete the modules under a node process of the other's test. A lock file outside the tree serializes
    them, and a stamp of package-lock.json's digest, written in node_modules once installed, makes the
    later asks no-ops."""
    lock = package_dir / "package-lock.json"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    stamp = package_dir / "node_modules" / ".tandem-npm-ci"
    key = hashlib.sha256(str(package_dir.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"tandem-npm-ci-{key}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == digest:
            return
        install(["npm", "ci", "--no-audit", "--no-fund"], cwd=package_dir)
        stamp.write_text(digest)
