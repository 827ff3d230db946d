"""`make demo` (`python -m tandem.demo`) end to end, as a developer on a fresh machine runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_demo_imports_the_default_model_and_answers_the_question_both_ways(tmp_path: Path) -> None:
    # A fresh HOME, so the demo imports the default model's GGUF file as it does on first use.
    result = subprocess.run(
        [sys.executable, "-m", "tandem.demo"],
        env={**os.environ, "HOME": str(tmp_path)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    models = tmp_path / ".cache" / "tandem" / "models"
    assert [p.name.startswith("SmolLM2-135M-Instruct-") for p in models.iterdir() if p.is_dir()] == [True]
    assert "[demo] encoder SERVING" in out and "[demo] decoder SERVING" in out
    answers = re.findall(r"streaming:\n\n(.*?)\n\n\[demo\] finished", out, re.S)
    assert len(answers) == 2 and all("Paris" in answer for answer in answers), out
    assert "[demo] both prompts gave the same text" in out
    assert re.search(r"\[demo\] finished: FINISH_REASON_EOS, \d+ prompt positions, [1-9]\d* tokens", out)
    assert re.search(r"\[demo\] trace id [0-9a-f]{32}", out), out
    assert "[demo] decoder stopped (exit 0)" in out and "[demo] encoder stopped (exit 0)" in out


def test_a_service_that_fails_to_start_shows_its_last_log_lines(tmp_path: Path) -> None:
    # The decoder refuses its configuration at once (exit 2); the demo shows why instead of a bare code.
    result = subprocess.run(
        [sys.executable, "-m", "tandem.demo"],
        env={**os.environ, "TANDEM_MAX_NUM_SEQS": "0"},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "the decoder exited with code" in result.stderr and "its last lines:" in result.stderr
    assert "--max-num-seqs (TANDEM_MAX_NUM_SEQS) must be >= 1, got 0" in result.stderr, result.stderr
