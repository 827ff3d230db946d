"""The locks on shared-memory files: what a killed reader or writer left is removed by the next one,
and nothing else is (a live or forked process's files, a young probe, other names, links, other users'
files)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.common.torch_part import shared_memory as shm
from tandem.common.torch_part import shm_locks, shm_pool, shm_probe


def test_only_the_pool_segments_of_a_writer_that_died_are_removed(tmp_path: Path) -> None:
    live = shm_pool.PooledSegment.create(tmp_path, 100)
    abandoned = shm.new_name(shm.POOL_PREFIX)  # what a killed writer leaves: a file nobody has locked
    (tmp_path / abandoned).write_bytes(bytes(100))
    other = tmp_path / ("tandem-pool-" + "0" * 31)  # not a pool name: never touched
    other.write_bytes(b"x")
    assert shm_locks.remove_abandoned(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    live.close()
    assert shm_locks.remove_abandoned(tmp_path / "no-such-directory") == 0


def _age(path: Path, seconds: float = 3600.0) -> None:
    """Makes `path` (not a link it may be) look modified `seconds` ago: past any grace period."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


# What a reader or a writer that is then killed leaves: its files, made by the module's own code, and
# their names on stdout once made.
_CHILD = """
import sys, time
from pathlib import Path
from tandem.common.torch_part import shared_memory as shm, shm_pool, shm_probe
directory = Path(sys.argv[1])
if sys.argv[2] == "probe":
    print(shm_probe.Probe.create(directory).name, flush=True)
else:
    segment, name = shm_pool.PooledSegment.create(directory, 4096), shm.new_name(shm.SEGMENT_PREFIX)
    segment.link(name)  # leased to a call when the writer died
    print(segment.name, name, flush=True)
time.sleep(60)
"""


@pytest.fixture
def spawn(tmp_path: Path):
    """Starts processes making files in tmp_path; returns (process, names made). Every one is killed."""
    started: list[subprocess.Popen] = []

    def start(kind: str) -> subprocess.Popen:
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(tmp_path), kind], stdout=subprocess.PIPE, text=True
            )
        )
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()
        process.stdout.close()


def _made(process: subprocess.Popen) -> list[str]:
    return process.stdout.readline().split()


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)  # no handler, no `close`: what the OOM killer does
    process.wait()


def test_a_killed_readers_probe_is_removed_by_the_next_probe_and_a_live_ones_never(
    tmp_path: Path, spawn
) -> None:
    killed, alive = spawn("probe"), spawn("probe")
    (killed_probe,), (live_probe,) = _made(killed), _made(alive)
    own = shm_probe.Probe.create(tmp_path)  # a live probe of this process
    _kill(killed)
    for name in (killed_probe, live_probe, own.name):
        _age(tmp_path / name)  # all past the grace period: only the lock tells them apart
    new = shm_probe.Probe.create(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_probe, own.name, new.name])
    assert shm_probe.probe_matches(tmp_path, own.name, own.token) and shm_probe.probe_matches(
        tmp_path, new.name, new.token
    )
    _kill(alive)
    shm_probe.Probe.create(tmp_path).close()  # the next one finds it abandoned too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own.name, new.name])
    own.close()
    new.close()
    assert not list(tmp_path.iterdir())


def test_a_probe_sweep_touches_nothing_but_old_unlocked_probe_files_of_this_user(tmp_path: Path) -> None:
    abandoned = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    abandoned.write_bytes(bytes(shm_probe.TOKEN_BYTES))
    young = tmp_path / shm.new_name(shm.PROBE_PREFIX)  # unlocked, but maybe between creation and lock
    young.write_bytes(bytes(shm_probe.TOKEN_BYTES))
    kept = [young]
    for name in (
        "other",
        "tandem-probe-" + "0" * 31,
        "tandem-probe-" + "A" * 32,
        "tandem-probe-x" + "0" * 32,
    ):
        (tmp_path / name).write_bytes(bytes(shm_probe.TOKEN_BYTES))
        kept.append(tmp_path / name)
    target = tmp_path / "target"  # an unlocked file, reached through a link named like a probe
    target.write_bytes(bytes(shm_probe.TOKEN_BYTES))
    link = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    link.symlink_to(target)
    folder = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    folder.mkdir()
    fifo = tmp_path / shm.new_name(shm.PROBE_PREFIX)
    os.mkfifo(fifo)
    kept += [target, link, folder, fifo]
    if os.geteuid() == 0:  # root may own files of another user: one named like a probe stays
        foreign = tmp_path / shm.new_name(shm.PROBE_PREFIX)
        foreign.write_bytes(bytes(shm_probe.TOKEN_BYTES))
        os.chown(foreign, 65534, 65534)
        kept.append(foreign)
    for path in [abandoned] + kept:
        if path != young:
            _age(path)
    probe = shm_probe.Probe.create(tmp_path)
    assert not os.path.lexists(abandoned)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([probe.name] + [p.name for p in kept])
    assert link.is_symlink() and target.read_bytes() == bytes(shm_probe.TOKEN_BYTES)
    probe.close()


def test_a_killed_writers_pool_segments_and_the_call_names_linked_to_them_are_removed(
    tmp_path: Path, spawn
) -> None:
    killed = spawn("pool")
    dead_pool, dead_call = _made(killed)
    _kill(killed)
    live, live_call = shm_pool.PooledSegment.create(tmp_path, 4096), shm.new_name(shm.SEGMENT_PREFIX)
    live.link(live_call)  # a live writer's lease: locked through its pool's file
    assert {dead_pool, dead_call} <= {p.name for p in tmp_path.iterdir()}
    assert shm_locks.remove_abandoned(tmp_path) == 2  # the call name held the dead pool's pages as well
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, live_call])
    shm.remove(tmp_path, live_call)
    live.close()


def test_a_probe_swept_before_its_lock_is_made_again_under_a_new_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two readers starting at once: one's sweep finds the other's new file not yet locked."""
    flock, swept = shm_locks.fcntl.flock, []

    def sweep_first(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_SH and not swept:
            swept.append(os.readlink(f"/proc/self/fd/{fd}"))
            assert shm_locks.remove_abandoned(tmp_path, (shm.PROBE_PREFIX,), 0.0) == 1  # the other's sweep
        flock(fd, operation)

    monkeypatch.setattr(shm_locks.fcntl, "flock", sweep_first)
    probe = shm_probe.Probe.create(tmp_path)
    assert probe is not None and len(swept) == 1 and not swept[0].endswith(probe.name)
    assert [p.name for p in tmp_path.iterdir()] == [probe.name]
    assert shm_probe.probe_matches(tmp_path, probe.name, probe.token)
    assert shm_locks.remove_abandoned(tmp_path, (shm.PROBE_PREFIX,), 0.0) == 0  # locked now
    probe.close()


# The fork happens in a fresh interpreter: forking pytest's own process, which holds earlier tests'
# gRPC and tracing threads, can leave the child stuck on a lock one of them held (one clean CI run hung
# 300 s in waitpid), and a single-threaded parent is what the probe's pid check is about anyway.
_FORK = """
import os, sys
from pathlib import Path
from tandem.common.torch_part import shared_memory as shm, shm_locks, shm_probe
directory = Path(sys.argv[1])
probe = shm_probe.Probe.create(directory)
child = os.fork()
if child == 0:  # the child's copy closed, as its exit or its own cleanup would
    probe.close()
    os._exit(0)
status = os.waitpid(child, 0)[1]
kept = shm_probe.probe_matches(directory, probe.name, probe.token)
swept = shm_locks.remove_abandoned(directory, (shm.PROBE_PREFIX,), 0.0)
probe.close()
print(status, kept, swept, len(list(directory.iterdir())))
"""


def test_a_forked_child_keeps_its_parents_probe_locked_and_never_removes_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORK, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    # the child exited 0; the file is still the parent's; its creator lives, so it is locked and no
    # sweep removes it; the parent's own close removes it
    assert done.stdout.split() == ["0", "True", "0", "0"]
