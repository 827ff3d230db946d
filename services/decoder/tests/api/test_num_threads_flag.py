"""--num-threads: torch's intra-op threads of each rank, at most the CPUs this process may run on (its
affinity mask, else the host's logical CPUs: config.max_num_threads).
More only take turns on the same CPUs, and far more took the host down: 100,000 starved it of processes
(SIGSEGV after the decoder listened), 2**31 failed torch.set_num_threads in a traceback. Past the bound
it is one line naming the flag and its limit, exit 2, before anything is loaded or listened on.
Left out, it is a container's CPU quota rounded up (cgroup v2 cpu.max) where that is below the CPUs and
torch's own default, else torch's default. How the CPUs and a quota are counted, from the affinity mask,
the host's count and cpu.max's text, is common/tests/common/test_cpus.py's (tandem.common.cpus)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.client.errors import ConfigError
from tandem.decoder import config
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import EngineConfig, max_num_threads

PREFIX = "tandem serve decoder: --num-threads (TANDEM_NUM_THREADS)"


def test_every_cpu_of_the_host_may_run_a_thread() -> None:
    assert config_from_args(["--num-threads", str(max_num_threads())]).engine.num_threads == max_num_threads()


@pytest.mark.parametrize("num_threads", [max_num_threads() + 1, 100_000, 2**31, 2**63])
def test_more_threads_than_cpus_are_one_line_naming_the_flag_and_the_limit(
    num_threads: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--num-threads", str(num_threads), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"{PREFIX} must be at most {max_num_threads():,} (the CPUs this process may run on: more threads "
        f"only take turns on them), got {num_threads:,}\n"
    )


def test_the_variable_is_refused_as_the_flag_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_NUM_THREADS", str(2**31))
    assert decoder_main(["--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"{PREFIX} must be at most {max_num_threads():,} (")


def test_the_bound_follows_the_affinity_mask_not_the_hosts_count(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`taskset -c 0` on a 2-CPU host: the host's count (2) let two threads take turns on one CPU."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert EngineConfig(model_dir=tmp_path, num_threads=3).num_threads == 3
    with pytest.raises(ConfigError) as error:
        EngineConfig(model_dir=tmp_path, num_threads=4)
    assert error.value.field == "num_threads"


def test_a_process_pinned_to_one_cpu_may_run_one_thread() -> None:
    """The decoder under `taskset -c 0`: its own mask, as the kernel applies it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a second CPU to pin away from")
    script = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from tandem.decoder.api.main import main; "
        "raise SystemExit(main(['--num-threads', '2', '--port', '0']))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.endswith(
        f"{PREFIX} must be at most 1 (the CPUs this process may run on: more threads only take turns on "
        "them), got 2\n"
    )


@pytest.fixture
def eight_cpus_with_a_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host of 8 CPUs, torch's default 8 threads, and a cgroup v2 cpu.max the test writes."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(config, "CGROUP_CPU_MAX", cpu_max)
    return cpu_max


def test_left_out_it_is_the_cpu_quota_rounded_up(eight_cpus_with_a_quota: Path) -> None:
    """docker run --cpus 1.5 on an 8-CPU host: torch's 8 threads took turns on 1.5 CPUs' time,
    throttled each period (Go 1.25's GOMAXPROCS and the JVM take the quota, rounded up)."""
    eight_cpus_with_a_quota.write_text("150000 100000\n")
    assert config_from_args([]).engine.num_threads == 2
    assert EngineConfig(model_dir=eight_cpus_with_a_quota.parent).num_threads == 2


@pytest.mark.parametrize("text", ["max 100000", "800000 100000", "1600000 100000"])
def test_left_out_without_a_quota_below_the_cpus_it_is_torchs_default(
    eight_cpus_with_a_quota: Path, text: str
) -> None:
    eight_cpus_with_a_quota.write_text(text + "\n")
    assert config_from_args([]).engine.num_threads is None  # the engine then runs torch.get_num_threads()


def test_the_quota_never_raises_torchs_own_default(
    eight_cpus_with_a_quota: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OMP_NUM_THREADS=1 makes torch's default 1: a quota of 3 CPUs keeps it."""
    eight_cpus_with_a_quota.write_text("300000 100000\n")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert config_from_args([]).engine.num_threads is None


def test_a_num_threads_given_may_pass_the_quota_up_to_the_cpus(eight_cpus_with_a_quota: Path) -> None:
    eight_cpus_with_a_quota.write_text("100000 100000\n")
    assert config_from_args(["--num-threads", "8"]).engine.num_threads == 8
    with pytest.raises(ConfigError) as error:
        config_from_args(["--num-threads", "9"])
    assert error.value.field == "num_threads" and "must be at most 8 " in str(error.value)
