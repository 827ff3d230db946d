"""`tandem up` whose reader left (`tandem up 2>&1 | head -3`): its output going nowhere never changes
how it stops. The relays keep draining the children, and a SIGTERM still drains both and exits 0.

The services are stand-ins (up_processes' `service_argv` replaced) that log a burst larger than a
pipe holds after the reader is gone and record the SIGTERM they were sent, so the test needs no model."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

# A service: says it started, logs 256 KiB (four pipes' worth) once the reader is gone, records that
# it got through, then drains on SIGTERM and records that too.
_SERVICE = """
import pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[2]) / sys.argv[1]
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
print("started", flush=True)
time.sleep(1.0)
for _ in range(256):
    print("x" * 1023, flush=True)
marker.write_text("logged")
while not asked:
    time.sleep(0.05)
marker.write_text("logged, drained")
"""

# `up` itself, with the stand-ins for services and no readiness probe (nothing listens).
_UP = """
import sys
from tandem import up_processes
from tandem.up_config import UpConfig
up_processes.service_argv = lambda name, config: [sys.executable, "-c", sys.argv[1], name, sys.argv[2]]
up_processes._announce_ready = lambda config, stopping: None
config = UpConfig(None, "127.0.0.1", 50781, 50782, None, None, grace_s=5.0)
sys.exit(up_processes.run_services(config))
"""


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_sigterm_after_the_reader_left_drains_both_services_and_exits_zero(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _UP, _SERVICE, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert process.stdout is not None
        started: set[str] = set()
        while started != {"encoder", "decoder"}:
            line = process.stdout.readline().decode()
            assert line, "up exited before both services started"
            if line.endswith("] started\n"):
                started.add(line[1:].split("]")[0])
        process.stdout.close()  # as `head -3` does: every later write of `up` is EPIPE
        markers = [tmp_path / "encoder", tmp_path / "decoder"]
        # Each logs four pipes' worth into relays with no reader: a relay that died would block it.
        is_logged = _wait_for(lambda: all(m.exists() for m in markers), timeout_s=20)
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert is_logged, "a service blocked writing its log once up's reader left"
    assert [m.read_text() for m in markers] == ["logged, drained"] * 2  # SIGTERM, not SIGKILL
    assert status == 0
