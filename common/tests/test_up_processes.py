"""`tandem up`'s children (`up_processes.py`): one service exiting on its own stops the rest, and one that
does not stop on SIGTERM is killed once the margin after the grace has passed, `up` exiting 1.

The services are stand-ins (`service_argv` replaced) that need no model; the config names a TLS
certificate so that `up` probes no readiness (nothing listens). How `up` stops when its reader has
left is test_up_closed_output.py."""

from __future__ import annotations

import sys
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
    assert lines[-4:] == [
        "[up] the encoder exited on its own (code 3): stopping the rest",
        "[up] the encoder stopped (exit 3)",
        f"[up] the decoder did not stop within {margin_s:g} s: killing it",
        "[up] the decoder stopped (exit -9)",
    ]
