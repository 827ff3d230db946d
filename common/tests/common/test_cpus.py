"""The CPUs this process may run on: its affinity mask, else the host's count."""

from __future__ import annotations

import os

import pytest

from tandem.common.cpus import available_cpus


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity mask on this system")
def test_the_affinity_mask_is_the_count_not_the_hosts_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `taskset -c 0` on a 2-CPU host: one CPU."""
    assert available_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert available_cpus() == 1


def test_without_an_affinity_mask_it_is_the_hosts_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no sched_getaffinity."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert available_cpus() == 8
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one, as os.cpu_count's users take it
    assert available_cpus() == 1
