"""The CPUs this process may run on: what the decoder's --num-threads and the gateway's --body-workers
are bounded by. Torch-free: the gateway imports it."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """Its affinity mask where the system has one (Linux: a container's cpuset, `taskset`), else the
    host's logical CPUs (1 where unknown, as os.cpu_count's users take it). The mask, not
    os.cpu_count(): under `taskset -c 0` on a 2-CPU host the host's count is 2 where 1 CPU runs it."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
