"""`make demo` (`python -m services.demo`) end to end, as a developer on a fresh machine runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_demo_creates_the_default_model_streams_a_generation_and_stops_both_services(tmp_path: Path) -> None:
    # A fresh HOME, so the demo writes the embedded default model as it does on first use.
    result = subprocess.run(
        [sys.executable, "-m", "services.demo"],
        env={**os.environ, "HOME": str(tmp_path)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert (tmp_path / ".cache" / "tandem" / "models" / "tandem-tiny" / "config.json").exists()
    assert "[demo] encoder SERVING" in out and "[demo] decoder SERVING" in out
    streamed = out.split("streaming:\n", 1)[1].split("[demo] finished", 1)[0]
    assert streamed.strip(), "no text was streamed"
    assert re.search(
        r"\[demo\] finished: FINISH_REASON_(LENGTH|EOS), \d+ prompt positions, [1-9]\d* tokens", out
    )
    assert re.search(r"\[demo\] trace id [0-9a-f]{32}", out), out
    assert "[demo] decoder stopped (exit 0)" in out and "[demo] encoder stopped (exit 0)" in out
