"""`tandem up`'s children (`up_processes.py`): one service exiting on its own stops the rest, and one that
does not stop on SIGTERM is killed once the margin after the grace has passed, `up` exiting 1. A
service's output is relayed to its end, but the stop does not wait for a grandchild that holds it.

The services are stand-ins (`service_argv` replaced) that need no model; the config names a TLS
certificate so that `up` probes no readiness (nothing listens). How `up` stops when its reader has
left is test_up_closed_output.py."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from common.tests.up_configs import up_config
from tandem import up_config as up_config_module
from tandem import up_processes

# The encoder exits 3 once the decoder has said it ignores SIGTERM (so `up`'s SIGTERM cannot reach the
# decoder before it ignores it); the decoder then sleeps past any margin a test gives it.
_SERVICE = """
import pathlib, signal, sys, time
name, ignoring = sys.argv[1], pathlib.Path(sys.argv[2])
if name == "decoder":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ignoring.write_text("yes")
    time.sleep(60)
while not ignoring.exists():
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_service_that_ignores_sigterm_is_killed_after_the_margin_and_up_exits_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    margin_s = 0.5
    monkeypatch.setattr(
        up_processes,
        "service_argv",
        lambda name, config: [sys.executable, "-c", _SERVICE, name, str(tmp_path / "ignoring")],
    )
    monkeypatch.setattr(up_config_module, "STOP_MARGIN_S", margin_s)  # read by UpConfig.kill_after_s
    config = up_config(None, grace_s=0.0, tls_cert=tmp_path / "cert.pem")
    assert up_processes.run_services(config) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[up] ")]
    # Each "stopped" once its output is relayed, after every service has exited (their relays' time
    # runs together): the kill is said before.
    assert lines[-4:] == [
        "[up] the encoder exited on its own (code 3): stopping the rest",
        f"[up] the decoder did not stop within {margin_s:g} s: killing it",
        "[up] the encoder stopped (exit 3)",
        "[up] the decoder stopped (exit -9)",
    ]


# The decoder starts two processes that inherit its stdout and stderr, as its ranks and multiprocessing's
# resource tracker do: one that outlives it (a rank still loading when it was killed) and one that says
# a last line 0.3 s after it has exited and then ends (a rank saying why it stops). On SIGTERM it logs four
# pipes' worth and a last line, then exits; the encoder exits 3 once the decoder waits for SIGTERM
# (and the second process watches it).
_LATE_LINE = """
import os, pathlib, sys, time
service = int(sys.argv[1])
pathlib.Path(sys.argv[2]).write_text("yes")
while os.getppid() == service:
    time.sleep(0.01)
time.sleep(0.3)
print("said after the decoder exited", file=sys.stderr, flush=True)
"""
_PARENT_SERVICE = """
import os, pathlib, signal, subprocess, sys, time
name, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
if name == "decoder":
    asked = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
    outliving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp / "outliving").write_text(str(outliving.pid))
    subprocess.Popen([sys.executable, "-c", sys.argv[3], str(os.getpid()), str(tmp / "watching")])
    while not (tmp / "watching").exists():
        time.sleep(0.01)
    (tmp / "waiting").write_text("yes")
    while not asked:
        time.sleep(0.01)
    for i in range(256):
        print(f"{i:03} " + "x" * 1019)
    print("last line", flush=True)
    sys.exit(0)
while not (tmp / "waiting").exists():
    time.sleep(0.01)
sys.exit(3)
"""


@pytest.mark.timeout(45)  # the grandchild outliving the decoder holds its output for 60 s
def test_the_stop_ends_each_relay_with_the_service_not_with_a_grandchild_that_holds_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        up_processes,
        "service_argv",
        lambda name, config: [sys.executable, "-c", _PARENT_SERVICE, name, str(tmp_path), _LATE_LINE],
    )
    # Generous for the grandchild's line after the decoder's exit; the one outliving it costs this once.
    monkeypatch.setattr(up_processes, "AFTER_EXIT_S", 2.0)
    threads_before = set(threading.enumerate())
    config = up_config(None, grace_s=0.0, tls_cert=tmp_path / "cert.pem")
    try:
        assert up_processes.run_services(config) == 1
        # Both relays of each service have ended, not left reading a pipe the grandchild still holds.
        left = [t for t in set(threading.enumerate()) - threads_before if t.name != "up-ready"]
        assert left == []
        outliving = int((tmp_path / "outliving").read_text())
        assert _is_running(outliving)  # the stop did not wait for it
    finally:
        if (tmp_path / "outliving").exists():
            os.kill(int((tmp_path / "outliving").read_text()), signal.SIGKILL)
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    # Everything the decoder wrote before it exited, in order, before `up` says it stopped.
    logged = [line for line in out if line.startswith("[decoder] ")]
    assert logged == [f"[decoder] {i:03} " + "x" * 1019 for i in range(256)] + ["[decoder] last line"]
    assert out.index("[decoder] last line") < out.index("[up] the decoder stopped (exit 0)")
    assert "[decoder] said after the decoder exited" in captured.err.splitlines()


class _HeldSink(io.StringIO):
    """An output whose first write waits until released: the relay is held writing, not reading."""

    def __init__(self) -> None:
        super().__init__()
        self.is_holding = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        if not self.is_holding.is_set():
            self.is_holding.set()
            self.release.wait(30)
        return super().write(text)


@pytest.mark.timeout(30)
def test_a_relay_finished_past_its_deadline_relays_what_the_pipe_holds_and_stops() -> None:
    read_end, write_end = os.pipe()  # the test keeps the write end open, as a grandchild would
    sink = _HeldSink()
    relay = up_processes._Relay("[decoder] ", os.fdopen(read_end, "rb", buffering=0), sink)
    try:
        os.write(write_end, b"first\n")
        assert sink.is_holding.wait(10)
        # Written while the relay is held: still in the pipe when the deadline passes.
        os.write(write_end, b"second\r\nthird, unended")
        relay.finish(time.monotonic())
        sink.release.set()
        relay.join()
    finally:
        os.close(write_end)
    assert sink.getvalue() == "[decoder] first\n[decoder] second\n[decoder] third, unended\n"


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may not reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# Each service starts a process that inherits its output and outlives it; the encoder exits 3 once the
# decoder's has started, and the decoder exits on `up`'s SIGTERM.
_BOTH_HELD = """
import pathlib, signal, subprocess, sys, time
name, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
(tmp / f"{name}-held").write_text(str(held.pid))
if name == "decoder":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(60)
while not (tmp / "decoder-held").exists():
    time.sleep(0.01)
sys.exit(3)
"""


@pytest.mark.timeout(45)
def test_each_services_relays_get_their_time_from_its_own_exit_not_after_the_one_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each relay's AFTER_EXIT_S was given when the service before it had ended its own: two services
    whose children held their pipes took twice the time to stop (1.1 s, where 0.5 s will do)."""
    monkeypatch.setattr(
        up_processes,
        "service_argv",
        lambda name, config: [sys.executable, "-c", _BOTH_HELD, name, str(tmp_path)],
    )
    after_exit_s = 2.0  # far past the time between the two exits, even on a loaded host
    monkeypatch.setattr(up_processes, "AFTER_EXIT_S", after_exit_s)
    deadlines: list[float] = []
    finish = up_processes._Relay.finish

    def finish_noted(relay: up_processes._Relay, stop_by: float) -> None:
        deadlines.append(stop_by)
        finish(relay, stop_by)

    monkeypatch.setattr(up_processes._Relay, "finish", finish_noted)
    config = up_config(None, grace_s=0.0, tls_cert=tmp_path / "cert.pem")
    try:
        assert up_processes.run_services(config) == 1
    finally:
        for held in tmp_path.glob("*-held"):
            os.kill(int(held.read_text()), signal.SIGKILL)
    assert len(deadlines) == 4  # two relays a service
    assert max(deadlines) - min(deadlines) < after_exit_s
