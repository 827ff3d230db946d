"""The memory a process may take is the least of the host's physical memory and the memory limits of
its cgroup and every cgroup above it, v2's memory.max or v1's memory.limit_in_bytes, found through
/proc/self/cgroup. Inside a container the host's memory alone passed pools its cgroup could not hold,
and the OOM killer struck when steps touched their pages. Every tree here is a fake one: no test reads
this machine's cgroups."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.common import memory_limit as memory_limit_module
from tandem.common.memory_limit import MemoryLimit, cgroup_limits, memory_limit, physical_memory_bytes

GIB = 1 << 30


def cgroup_tree(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup saying `proc_cgroup` and a cgroup mount holding `files` (path: content)."""
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_cgroup)
    root = tmp_path / "cgroup"
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    return proc, root


def test_a_v2_container_with_its_own_namespace_is_limited_by_the_mounts_root(tmp_path: Path) -> None:
    proc, root = cgroup_tree(tmp_path, "0::/\n", {"memory.max": f"{4 * GIB}\n"})
    assert cgroup_limits(proc, root) == [MemoryLimit(4 * GIB, root / "memory.max")]


def test_a_parents_limit_bounds_its_child_and_max_is_no_limit(tmp_path: Path) -> None:
    proc, root = cgroup_tree(
        tmp_path,
        "0::/user.slice/decoder.scope\n",
        {"user.slice/decoder.scope/memory.max": "max\n", "user.slice/memory.max": f"{2 * GIB}\n"},
    )
    assert cgroup_limits(proc, root) == [MemoryLimit(2 * GIB, root / "user.slice/memory.max")]


def test_v1s_memory_controller_is_read_under_its_own_mount(tmp_path: Path) -> None:
    """Without a cgroup namespace the container sees the host's path, which its mount does not hold:
    the mount's root is its own cgroup."""
    proc, root = cgroup_tree(
        tmp_path,
        "12:memory:/docker/0123abcd\n4:cpu,cpuacct:/docker/0123abcd\n",
        {"memory/memory.limit_in_bytes": f"{3 * GIB}\n", "cpu,cpuacct/memory.limit_in_bytes": "1\n"},
    )
    assert cgroup_limits(proc, root) == [MemoryLimit(3 * GIB, root / "memory/memory.limit_in_bytes")]


def test_no_cgroup_files_is_no_cgroup_limit(tmp_path: Path) -> None:
    assert cgroup_limits(tmp_path / "no_such_file", tmp_path) == []
    proc, root = cgroup_tree(tmp_path, "0::/a\n", {})
    assert cgroup_limits(proc, root) == []


def test_the_limit_is_the_least_of_the_hosts_memory_and_its_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory_limit_module, "physical_memory_bytes", lambda: 64 * GIB)
    proc, root = cgroup_tree(
        tmp_path,
        "0::/a\n7:memory:/a\n",
        {"a/memory.max": f"{8 * GIB}", "memory/a/memory.limit_in_bytes": "9"},
    )
    assert memory_limit(proc, root) == MemoryLimit(9, root / "memory/a/memory.limit_in_bytes")
    # v1's "no limit" is a huge number, not "max": the host's memory is then the least
    proc, root = cgroup_tree(
        tmp_path, "7:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}
    )
    assert memory_limit(proc, root) == MemoryLimit(64 * GIB, None)
    monkeypatch.setattr(memory_limit_module, "physical_memory_bytes", lambda: None)
    assert memory_limit(tmp_path / "no_such_file", root) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysconf's names are Linux's")
def test_the_hosts_memory_is_known_on_linux() -> None:
    assert physical_memory_bytes() > 0
