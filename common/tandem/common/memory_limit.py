"""The memory this process may take: the host's physical memory, or its cgroup's limit where smaller.

In tandem.common, torch-free, so that every process with a memory bound can use it: the decoder
bounds its KV pool by it, the gateway the large bodies it holds at once (a gateway limited to 1 GiB
took 4 bodies of 512 MiB on a 64 GiB node).

NOTE: why the cgroup. Inside a container (a cgroup with a memory limit) the host's physical memory says
nothing of what the process may hold: a KV pool within the host's memory but past the cgroup's limit
passed the check, mapped lazily (where the kernel overcommits), and the OOM killer ended the decoder
when steps touched its pages. So the limit is the least of the physical memory and the limits of this
process's cgroup and of every cgroup above it (a parent's limit bounds its children): cgroup v2's
`memory.max`, v1's `memory.limit_in_bytes`. Neither counts swap (v2 bounds it apart, in
`memory.swap.max`), nor does the physical memory: a pool that would fit only with swap is refused.

Where the files are: /proc/self/cgroup names this process's cgroup in each hierarchy ("0::/path" for
v2, "N:...memory...:/path" for v1's memory controller), under the usual mounts (/sys/fs/cgroup for
v2, /sys/fs/cgroup/memory for v1). A container with its own cgroup namespace sees "/" there, its own
cgroup at the mount's root; one without sees the host's path, which its mount does not hold: the walk
up then finds the mount's root alone, which is again the container's own cgroup. Nothing is found
where there are no such files (macOS, a host without cgroups): the physical memory alone then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")  # v2's unified mount; v1's memory controller is under memory/
V2_LIMIT = "memory.max"
V1_LIMIT = "memory.limit_in_bytes"


@dataclass(frozen=True)
class MemoryLimit:
    """The most memory this process may take, and what sets it."""

    num_bytes: int  # pages this process may hold, swap not counted
    cgroup_file: Path | None  # the cgroup file that says so; None: the host's physical memory


def memory_limit(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> MemoryLimit | None:
    """The least of the host's physical memory and this process's cgroup limits (the module's NOTE);
    None where nothing says. The paths are parameters so tests can give a tree of their own."""
    physical = physical_memory_bytes()
    limits = [] if physical is None else [MemoryLimit(physical, None)]
    limits += cgroup_limits(proc_cgroup, cgroup_root)
    return min(limits, key=lambda limit: limit.num_bytes, default=None)


def physical_memory_bytes() -> int | None:
    """The host's physical memory in bytes; None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None


def cgroup_limits(proc_cgroup: Path, cgroup_root: Path) -> list[MemoryLimit]:
    """Every memory limit set on this process's cgroups and their ancestors, v2 and v1 alike; none
    where the files are missing or unreadable, or say "max" (no limit)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        fields = line.split(":", 2)  # hierarchy id, controllers, path (which may hold colons itself)
        if len(fields) != 3:
            continue
        _hierarchy_id, controllers, path = fields
        if controllers == "":  # v2's one unified hierarchy
            limits += _limits_up(cgroup_root, path, V2_LIMIT)
        elif "memory" in controllers.split(","):  # v1's memory controller
            limits += _limits_up(cgroup_root / "memory", path, V1_LIMIT)
    return limits


def _limits_up(mount: Path, path: str, name: str) -> list[MemoryLimit]:
    """The limit file `name` of cgroup `path` under `mount` and of each cgroup above it, where present."""
    parts = [part for part in path.split("/") if part and part != "."]
    if ".." in parts:  # a cgroup outside this namespace's view: only the mount's root is ours
        parts = []
    limits = []
    for depth in range(len(parts), -1, -1):
        file = mount.joinpath(*parts[:depth], name)
        try:
            said = file.read_text().strip()
        except OSError:  # missing: not mounted here, or the root cgroup (which has no limit file)
            continue
        if said.isdigit():  # "max": no limit here
            limits.append(MemoryLimit(int(said), file))
    return limits
