"""The CPUs this process may run on: its affinity mask, else the host's count; and a cgroup v2 CPU
quota's CPUs, rounded up (None: no quota, or none it can read)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.common.cpus import available_cpus, quota_cpus


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


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        (b"150000 100000\n", 2),  # docker run --cpus 1.5: rounded up
        (b"100000 100000\n", 1),
        (b"5000 100000\n", 1),  # a twentieth of a CPU: still one thread
        (b"400000 100000\n", 4),
        (b"200001 100000\n", 3),
    ],
)
def test_a_cgroup_quota_is_its_cpus_rounded_up(tmp_path: Path, text: bytes, cpus: int) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_bytes(text)
    assert quota_cpus(cpu_max) == cpus


@pytest.mark.parametrize(
    "text",
    [
        b"max 100000\n",  # cgroup v2's "no quota"
        b"",
        b"150000\n",
        b"150000 100000 7\n",
        b"abc 100000\n",
        b"0 100000\n",
        b"-1 100000\n",
        b"150000 0\n",
        b"1" * 65 + b" 100000\n",  # past the 64 bytes the file can hold: not that file
    ],
)
def test_no_quota_or_one_it_cannot_read_is_none(tmp_path: Path, text: bytes) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_bytes(text)
    assert quota_cpus(cpu_max) is None


def test_a_missing_file_a_directory_or_a_device_is_no_quota(tmp_path: Path) -> None:
    """cgroup v1 and a host's root cgroup have no cpu.max; /dev/zero is read 65 bytes, not for ever."""
    assert quota_cpus(tmp_path / "missing") is None
    assert quota_cpus(tmp_path) is None
    assert quota_cpus(Path("/dev/zero")) is None
