"""The CPUs this process may run on: what the decoder's --num-threads and the gateway's --body-workers
are bounded by; and the CPU time a container's quota gives it, what the decoder's default threads
follow. Torch-free: the gateway imports it."""

from __future__ import annotations

import os
from pathlib import Path

# cgroup v2's CPU bandwidth limit of this process's cgroup, as a container sees it (its own cgroup
# namespace: the root of /sys/fs/cgroup is the container's): "<quota> <period>" in microseconds, or
# "max <period>" for none. Absent under cgroup v1 and outside Linux; on a host, the root cgroup has none.
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
# The file is one short line ("max 100000\n", "150000 100000\n"): more is not that file.
_MAX_CPU_MAX_BYTES = 64


def available_cpus() -> int:
    """Its affinity mask where the system has one (Linux: a container's cpuset, `taskset`), else the
    host's logical CPUs (1 where unknown, as os.cpu_count's users take it). The mask, not
    os.cpu_count(): under `taskset -c 0` on a 2-CPU host the host's count is 2 where 1 CPU runs it."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def quota_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """The CPUs' worth of time a cgroup v2 quota (`cpu.max`) gives, rounded up and at least 1:
    "150000 100000" (1.5 CPUs) is 2, "5000 100000" is 1. None where there is no quota: "max", no such
    file, or one that cannot be read or is not of that form (a quota nobody can read bounds nothing,
    and the start goes on as without one). The file is read at most 64 bytes, so a path to a device
    bounds the read. The kernel throttles a cgroup past its quota in each period: threads beyond it
    do not run faster, they wait (`docker run --cpus 1.5` writes "150000 100000")."""
    try:
        # O_NONBLOCK: a FIFO at the path would otherwise wait for a writer.
        fd = os.open(cpu_max, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        text = os.read(fd, _MAX_CPU_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = text.split()
    if len(text) > _MAX_CPU_MAX_BYTES or len(fields) != 2 or fields[0] == b"max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota < 1 or period < 1:
        return None
    return max(1, -(-quota // period))  # rounded up, as Go's GOMAXPROCS: 1.5 CPUs run 2 threads
