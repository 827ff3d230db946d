"""peft's regular-expression target_modules and exclude_modules: the module names a pattern fullmatches,
found in a worker process with bounded time and memory.

peft takes a string (other than "all-linear") as a pattern and adapts the modules whose full name
`re.fullmatch`es it, so matching must be Python's own `re` to adapt the same modules. But `re` cannot be
interrupted: an adapter's pattern may backtrack catastrophically even on these short names
(`(.*)*x` tries ~2^n ways to split a name of n characters), and it would hold the one adapter-reader
thread, every later load and the server's exit, for ever. So the match runs in a process of its own,
`python -I -S` running this file (stdlib only, no Tandem import): killed past TIME_LIMIT_S, its address
space capped at MEMORY_BYTES (a pattern's backtracking stack grows too). A real pattern matches the few
hundred names in microseconds; the worker's start is ~30 ms, paid only by an adapter that has a pattern.
"""

from __future__ import annotations

import json
import subprocess
import sys

TIME_LIMIT_S = 2.0  # the worker's whole life: start, compile and every match
MEMORY_BYTES = 256 * 1024 * 1024
MAX_PATTERN_CHARS = 4096  # unsloth's longest, for vision-language models, is under 400


class PatternError(Exception):
    """The pattern cannot be matched: it does not compile, or exceeded a bound. One line for the caller."""


def fullmatches(pattern: str, names: list[str], time_limit_s: float | None = None) -> frozenset[str]:
    """The names `re.fullmatch(pattern, name)` holds for, as peft finds them. Raises PatternError."""
    time_limit_s = TIME_LIMIT_S if time_limit_s is None else time_limit_s
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"a regular expression of {len(pattern)} characters: at most {MAX_PATTERN_CHARS}")
    job = json.dumps({"pattern": pattern, "names": names, "memory_bytes": MEMORY_BYTES})
    try:
        # -I: no environment variable, user site or working directory reaches the worker; -S: no site.
        done = subprocess.run(
            [sys.executable, "-I", "-S", __file__],
            input=job.encode(),
            capture_output=True,
            timeout=time_limit_s,
            check=False,
        )
    except subprocess.TimeoutExpired:  # run() killed the worker
        raise PatternError(
            f"the regular expression did not finish matching {len(names)} module names within "
            f"{time_limit_s:g} s (catastrophic backtracking)"
        ) from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:  # killed at the memory cap (MemoryError), or the interpreter failed to start
        raise PatternError(
            f"the regular expression could not be matched within {MEMORY_BYTES >> 20} MiB "
            f"(worker exit status {done.returncode})"
        ) from None
    if "error" in answer:
        raise PatternError(f"is not a regular expression Python's re compiles: {answer['error']}")
    return frozenset(answer["matched"])


def _worker() -> None:
    """The worker: one JSON job on stdin, one JSON answer on stdout."""
    import re
    import resource

    job = json.load(sys.stdin)
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    try:
        compiled = re.compile(job["pattern"])
    except (re.error, RecursionError, OverflowError, ValueError) as error:
        print(json.dumps({"error": str(error)[:200]}))
        return
    print(json.dumps({"matched": [name for name in job["names"] if compiled.fullmatch(name)]}))


if __name__ == "__main__":
    _worker()
