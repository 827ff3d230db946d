"""A spawned rank ends with the rank 0 that spawned it, however rank 0 ended, SIGKILL included.

Rank 0 here is a stand-in that spawns rank 1 the way the decoder does (`spawn_local_ranks`) and never
joins the group itself, as a decoder SIGKILLed before its engine did. The group's store address is
held by the test, which accepts rank 1's connection and never answers it: a store that outlives rank 0,
so rank 1 learns nothing from a closed connection and, in the rendezvous, would wait the group's
timeout (10 minutes here); it ran on for that long after its rank 0 was killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.tests.ports import free_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

COLLECTIVE_TIMEOUT_S = 600  # what rank 1 would wait for rank 0's store, and be left running for
GONE_WITHIN_S = 60.0  # generous on 2 busy cores: 0.1-0.2 s measured once rank 1 runs, ~3 s mid-import

RANK_0 = """
import sys, time
from pathlib import Path
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.distributed.parallel import RankInfo
from tandem.decoder.distributed.worker import spawn_local_ranks

engine = EngineConfig(model_dir=Path(sys.argv[1]), device="cpu", dtype="float32", num_threads=1)
config = DecoderConfig(engine=engine, world_size=2, collective_timeout_s=float(sys.argv[3]))
[rank_1] = spawn_local_ranks(config, RankInfo.local(0, 2, int(sys.argv[2])))
print(rank_1.pid, flush=True)
time.sleep(3600)
"""


class _Lines:
    """The lines a group writes to its shared stderr, read on a thread of its own as they come."""

    def __init__(self, stream: Iterator[str]) -> None:
        self.lines: list[str] = []
        self._added = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Iterator[str]) -> None:
        for line in stream:
            with self._added:
                self.lines.append(line)
                self._added.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> bool:
        with self._added:
            return self._added.wait_for(lambda: any(text in line for line in self.lines), timeout_s)


def _running(pid: int) -> bool:
    """Running (not gone, nor a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`: the ranks it spawned and multiprocessing's resource tracker."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):  # it ended since the listing
            pass
    return children


WAITING_ON_THE_STORE = "while rank 1 waits on the group's store"


@pytest.mark.parametrize("killed", [WAITING_ON_THE_STORE, "before rank 1 began watching"])
def test_a_rank_whose_rank_0_was_sigkilled_exits_at_once_and_leaves_nothing_behind(
    tiny_model_dir: Path, killed: str
) -> None:
    store = socket.create_server(("127.0.0.1", free_port()))
    store.settimeout(120)  # rank 1's interpreter start and imports, on 2 busy cores
    port = str(store.getsockname()[1])
    command = [sys.executable, "-c", RANK_0, str(tiny_model_dir), port, str(COLLECTIVE_TIMEOUT_S)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    rank_0 = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert rank_0.stdout is not None and rank_0.stderr is not None
    log = _Lines(rank_0.stderr)  # rank 1's too: it writes to the stderr it inherited
    left: list[int] = []
    held: list[socket.socket] = []
    try:
        printed = rank_0.stdout.readline()
        assert printed, "".join(log.lines)  # the stand-in failed before it spawned rank 1
        rank_1 = int(printed)
        if killed == WAITING_ON_THE_STORE:
            held.append(store.accept()[0])  # rank 1 is in init_parallel, past the start of its watch
        left = _children(rank_0.pid)
        assert rank_1 in left
        rank_0.kill()
        rank_0.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(map(_running, left)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in left if _running(pid)], "".join(log.lines)
        assert log.wait_for(f"rank 1 stopping: rank 0 (pid {rank_0.pid}) has exited", 5), log.lines
    finally:
        for connection in [store, *held]:  # held open, unanswered, until rank 1 was gone
            connection.close()
        rank_0.kill()
        for pid in left:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
