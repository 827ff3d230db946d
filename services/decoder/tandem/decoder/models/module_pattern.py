"""peft's regular-expression target_modules and exclude_modules: the module names a pattern fullmatches,
found in a worker process with bounded CPU time and memory.

peft takes a string (other than "all-linear") as a pattern and adapts the modules whose full name
`re.fullmatch`es it, so matching must be Python's own `re` to adapt the same modules. But `re` cannot be
interrupted: an adapter's pattern may backtrack catastrophically even on these short names
(`(.*)*x` tries ~2^n ways to split a name of n characters), and it would hold the one adapter-reader
thread, every later load and the server's exit, for ever. So the match runs in a process of its own,
`python -I -S` running this file (stdlib only, no Tandem import), bounded by what it uses, not by the
clock: CPU_LIMIT_S of CPU time (RLIMIT_CPU; a wall-clock limit counted the interpreter's start, so on a
loaded host valid patterns were refused: 8 of 10 runs beside 24 busy processes) and MEMORY_BYTES of
address space (a pattern's backtracking stack grows too). The CPU limit holds without the decoder too:
a worker a SIGKILLed decoder left behind ends within it (no prctl death signal: the model package loads
no native code, tests/unit/test_architecture.py). A real pattern matches the few hundred names in
microseconds; the worker's start is ~30 ms, paid once per pattern and set of names (answers, refusals
too, are cached: 50 adapters with one bad pattern cost one CPU limit, not 50).
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys

CPU_LIMIT_S = 2  # the worker's CPU time, start-up included (RLIMIT_CPU counts whole seconds)
WALL_LIMIT_S = 30.0  # a backstop only: a worker stopped (SIGSTOP) or starved spends no CPU
MEMORY_BYTES = 256 * 1024 * 1024
MAX_PATTERN_CHARS = 4096  # unsloth's longest, for vision-language models, is under 400
_CACHED = 256  # (pattern, names) answers kept: a server sees few distinct patterns


class PatternError(Exception):
    """The pattern cannot be matched: it does not compile, or exceeded a bound. One line for the caller."""


class HostError(PatternError):
    """The host, not the pattern, kept the worker from answering (fork refused, worker killed, stopped):
    raised inside the cached function, so it is not cached (lru_cache keeps no exceptions) and the
    next load of the same pattern tries again instead of being refused until a restart."""


def fullmatches(pattern: str, names: list[str], cpu_limit_s: int = CPU_LIMIT_S) -> frozenset[str]:
    """The names `re.fullmatch(pattern, name)` holds for, as peft finds them. Raises PatternError."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"a regular expression of {len(pattern)} characters: at most {MAX_PATTERN_CHARS}")
    answer = _match(pattern, tuple(names), cpu_limit_s)  # HostError passes through, uncached
    if isinstance(answer, str):
        raise PatternError(answer)
    return answer


@functools.lru_cache(maxsize=_CACHED)
def _match(pattern: str, names: tuple[str, ...], cpu_limit_s: int) -> frozenset[str] | str:
    """The names matched, or why the pattern cannot be (a string, so that such a refusal is cached as well
    as an answer). Raises HostError where the host, not the pattern, is why there is no answer."""
    job = json.dumps({"pattern": pattern, "names": names, "memory_bytes": MEMORY_BYTES})
    command = [sys.executable, "-I", "-S", __file__, str(cpu_limit_s)]
    try:
        # -I: no environment variable, user site or working directory reaches the worker; -S: no site.
        done = subprocess.run(
            command, input=job.encode(), capture_output=True, timeout=WALL_LIMIT_S, check=False
        )
    except (
        subprocess.TimeoutExpired
    ) as error:  # run() killed the worker: stopped or starved, not the CPU bound
        raise HostError(
            f"the regular expression did not finish matching {len(names)} names within {WALL_LIMIT_S:g} s"
        ) from error
    except OSError as error:  # no interpreter at sys.executable, fork refused (EAGAIN)...
        raise HostError(
            f"the worker that matches the regular expression could not start ({error})"
        ) from error
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        return _no_answer(done, len(names), cpu_limit_s)
    if "error" in answer:
        return f"is not a regular expression Python's re compiles: {answer['error']}"
    return frozenset(answer["matched"])


def _no_answer(done: subprocess.CompletedProcess[bytes], count: int, cpu_limit_s: int) -> str:
    """Why the worker gave no answer, from how it ended: the pattern's bounds (CPU, memory) are returned to be
    cached; anything else (another signal, an exit with no answer) is the host's and raises HostError."""
    worker = "the worker matching the regular expression"
    if done.returncode == -signal.SIGXCPU:  # RLIMIT_CPU's soft limit
        return (
            f"the regular expression did not finish matching {count} names within {cpu_limit_s} CPU seconds"
        )
    if done.returncode < 0:  # the OOM killer, an operator: a later try may succeed
        raise HostError(f"{worker} was killed by {signal.Signals(-done.returncode).name}")
    last = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:120]
    if "MemoryError" in last:  # RLIMIT_AS
        return f"the regular expression could not be matched within {MEMORY_BYTES >> 20} MiB"
    raise HostError(f"{worker} exited with status {done.returncode} ({last or 'no output'})")


def _worker(cpu_limit_s: int) -> None:
    """The worker: one JSON job on stdin, one JSON answer on stdout."""
    import re
    import resource

    # SIGXCPU at the soft limit says why; SIGKILL a second later if it was caught or ignored.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit_s, cpu_limit_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU's default action dumps core
    job = json.load(sys.stdin)
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    try:
        compiled = re.compile(job["pattern"])
    except (re.error, RecursionError, OverflowError, ValueError) as error:
        print(json.dumps({"error": str(error)[:200]}))
        return
    print(json.dumps({"matched": [name for name in job["names"] if compiled.fullmatch(name)]}))


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
