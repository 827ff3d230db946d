"""peft's regular-expression target_modules matched in a worker: Python's re.fullmatch exactly, and a
pattern that does not compile, is too long, or backtracks past its CPU time refused in one line; answers
and the pattern's own refusals are cached, the host's failures are not, and the worker dies with the
process that started it."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tandem.decoder.models import module_pattern
from tandem.decoder.models.module_pattern import MAX_PATTERN_CHARS, PatternError, fullmatches

NAMES = [f"model.layers.{layer}.self_attn.{m}" for layer in range(3) for m in ("q_proj", "v_proj")] + [
    "lm_head"
]


@pytest.fixture(autouse=True)
def _no_cached_answers() -> Iterator[None]:
    module_pattern._match.cache_clear()
    yield
    module_pattern._match.cache_clear()


@pytest.mark.parametrize(
    "pattern",
    [
        r".*\.(q_proj|v_proj)$",
        r"(?:.*?(?:language|text).*?)?model\.layers\.[01]\..*?q_proj",
        r"(?i)LM_HEAD|model\.layers\.2\.self_attn\.v_proj",
        "q_proj",  # fullmatch: no whole name is just this
    ],
)
def test_the_names_matched_are_those_re_fullmatch_finds(pattern: str) -> None:
    assert fullmatches(pattern, NAMES) == {name for name in NAMES if re.fullmatch(pattern, name)}


def test_a_pattern_that_backtracks_for_ever_is_cut_off_at_its_cpu_time_not_the_clock() -> None:
    # CPU time, not wall time: a loaded host slows the worker's start without refusing a valid pattern.
    with pytest.raises(PatternError, match="did not finish matching 7 names within 1 CPU seconds$"):
        fullmatches(r"(.*.*.*.*.*)*x", NAMES, cpu_limit_s=1)


def test_a_refusal_is_cached_as_well_as_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fullmatches(r".*q_proj", NAMES) == {name for name in NAMES if name.endswith("q_proj")}
    with pytest.raises(PatternError, match="missing") as first:
        fullmatches("(q_proj", NAMES)

    def no_worker(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker started for a pattern already matched")

    monkeypatch.setattr(module_pattern.subprocess, "run", no_worker)
    assert fullmatches(r".*q_proj", NAMES) == {name for name in NAMES if name.endswith("q_proj")}
    with pytest.raises(PatternError) as again:
        fullmatches("(q_proj", NAMES)
    assert str(again.value) == str(first.value)


@pytest.mark.parametrize(
    ("executable", "says"),
    [
        ("", "worker that matches the regular expression could not start"),
        ("/nonexistent/python", "could not start .*No such file"),
        ("/bin/false", "exited with status 1 \\(no output\\)"),  # not a memory cap it never reached
    ],
)
def test_a_worker_that_cannot_start_or_answer_is_a_pattern_error(
    monkeypatch: pytest.MonkeyPatch, executable: str, says: str
) -> None:
    monkeypatch.setattr(module_pattern.sys, "executable", executable)
    with pytest.raises(PatternError, match=says):
        fullmatches(r".*q_proj", NAMES)


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), "could not start"),
        (subprocess.TimeoutExpired("python", module_pattern.WALL_LIMIT_S), "within 30 s"),
        (subprocess.CompletedProcess("python", -signal.SIGKILL, b"", b""), "killed by SIGKILL"),
        (subprocess.CompletedProcess("python", 1, b"", b""), "exited with status 1"),
    ],
)
def test_a_failure_of_the_host_is_not_cached_so_the_next_load_matches(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException | subprocess.CompletedProcess[bytes], says: str
) -> None:
    # A fork refused once, or a worker the OOM killer took, says nothing about the pattern: a cached
    # refusal would refuse every later load of it until a restart.
    real_run = subprocess.run

    def fails_once(*args: object, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        monkeypatch.setattr(module_pattern.subprocess, "run", real_run)
        if isinstance(failure, BaseException):
            raise failure
        return failure

    monkeypatch.setattr(module_pattern.subprocess, "run", fails_once)
    with pytest.raises(PatternError, match=says):
        fullmatches(r".*q_proj", NAMES)
    assert fullmatches(r".*q_proj", NAMES) == {name for name in NAMES if name.endswith("q_proj")}


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_parent_died_still_ends_at_its_cpu_limit() -> None:
    # A parent starts a worker (1 CPU second) on a pattern that backtracks for ever, then is SIGKILLed.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            f"w = subprocess.Popen([sys.executable, '-I', '-S', {module_pattern.__file__!r},"
            " '1'], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)\n"
            'w.stdin.write(b\'{"pattern": "(.*.*.*.*.*)*x", "names": ["model.layers.0.mlp.up_proj"],'
            ' "memory_bytes": 268435456}\'); w.stdin.close()\n'
            "print(w.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    worker = int(parent.stdout.readline())
    try:
        time.sleep(0.2)  # the worker is matching
        assert _alive(worker)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30  # 1-2 CPU seconds on a loaded 2-core box
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(worker)
    finally:
        parent.kill()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (not gone, nor a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("(q_proj", "not a regular expression Python's re compiles: missing \\)"),
        ("a" * (MAX_PATTERN_CHARS + 1), f"at most {MAX_PATTERN_CHARS}"),
    ],
)
def test_a_pattern_that_cannot_be_matched_is_refused_in_one_line(pattern: str, says: str) -> None:
    with pytest.raises(PatternError, match=says) as raised:
        fullmatches(pattern, NAMES)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300
