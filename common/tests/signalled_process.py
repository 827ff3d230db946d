"""A service's command run as a process and signalled at a point of its start-up, for the stopping
tests of both services: how long after the signal it exited, with what status, having logged what."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SETTLE_S = 0.5  # after the line: well into the step it announces (a load of seconds)
MAX_WAIT_S = 120.0  # a process that outlives this after the signal is killed, and the test fails


@dataclass(frozen=True)
class Exited:
    after_s: float  # from the signal to the end of the process and of its output
    status: int  # the process's exit status
    log: str  # stdout and stderr together, as the process wrote them


def signal_after_line(
    command: Sequence[str], sig: signal.Signals, after: str, env: Mapping[str, str], to_group: bool = False
) -> Exited:
    """Runs `command`, sends it `sig` SETTLE_S after it logs a line holding `after`, and waits for it
    (and for whatever holds its output open, a child left behind included) to end. `to_group`: the
    signal goes to every process of its group, children included, as a terminal's Ctrl-C does (the
    command then leads a session of its own)."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=to_group
    )
    lines: list[str] = []
    try:
        assert process.stdout is not None
        while not lines or after not in lines[-1]:
            line = process.stdout.readline().decode(errors="replace")
            assert line, f"the process exited before it logged {after!r}: {''.join(lines)}"
            lines.append(line)
        time.sleep(SETTLE_S)
        signalled = time.monotonic()
        if to_group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        output, _ = process.communicate(timeout=MAX_WAIT_S)
        after_s = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return Exited(after_s, process.returncode, "".join(lines) + output.decode(errors="replace"))
