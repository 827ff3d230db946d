"""Chat templates rendered in worker processes with bounded time and memory.

A chat template is code, the caller's own or a checkpoint's (a GGUF file's metadata is untrusted
input too). Jinja2's sandbox stops it reaching attributes, files or the arguments, but not spending:
issue 32 measured `{% set x = 'a' * 10**9 %}` taking a server from 1.6 to 5.4 GB, `'a'|center(10**9)`
16.5 s of silence, and a looping template delaying every other caller's request by 7.6-57.7 s. In a
process of its own a render can be bounded by what the operating system enforces, not by checks the
template might find a way around:
- memory: the worker's address space is capped (RLIMIT_AS, MEMORY_BYTES); past it the render fails
  with MemoryError and the worker is replaced;
- time: a render that has not answered within TIME_LIMIT_S is killed with its worker;
- output: MAX_RENDERED_CHARS, counted while the template produces it.
A bound exceeded is the request's INVALID_ARGUMENT naming `chat.chat_template` (chat.py).

The workers are plain `python -m tandem.decoder.engine.admission.template_worker_main` processes that
import only Jinja2 (no torch, about 20 MB each), spoken to with one JSON line each way, so a render
costs a few hundred microseconds of pipe work. `TemplateWorkers` keeps WORKERS of them; two renders run
at once, so one slow template does not hold up another caller's chat (and the request-building threads
wait on a pipe, the GIL released). Each worker compiles a template once and keeps the last
CACHED_TEMPLATES (template_worker_main.py).
`compile` compiles and renders nothing: the decoder asks it of the checkpoint's template before it
listens (template_source.py). Compiling is bounded as rendering is, for it runs some of the template:
Jinja folds constant expressions while compiling (`{{ 'a' * 10**8 }}` allocates its 100 MB then,
`{{ 10 ** (10 ** 7) }}` takes 9 s).

NOTE: a request is judged by its own template's render time alone, never by a worker's start. A
worker writes a ready line once its interpreter, memory cap and Jinja2 are in place (0.09-0.17 s on
2 cores at load 3.4, 0.31-0.44 s with four CPU-bound processes beside it), and a render's clock
starts when its job is written to a worker that has said so. The pool's workers start when it is
built (at the engine's start), and a worker that is killed or retires is replaced at once, before
any request needs the slot; a request that takes a worker still starting waits for its ready line up
to START_LIMIT_S, then its render gets the full time limit. So the longest a render call waits,
once it holds a slot, is START_LIMIT_S + its time limit (11 s for a request), and the template's
part of that is never more than its limit. A worker that does not start within START_LIMIT_S is
killed and replaced, and that call fails with TemplateWorkerUnavailable (UNAVAILABLE: not the
caller's fault, and a retry may succeed).

This module is the server's side and the bounds both sides keep; template_worker_main.py is what runs
in the worker, rendering in template_sandbox.py's environment.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

MAX_RENDERED_CHARS = 1 << 20  # 1 MiB of rendered text: far above any context this serves
TIME_LIMIT_S = 1.0  # a real template renders in about a millisecond
MEMORY_BYTES = 512 * 1024 * 1024  # the worker's whole address space, interpreter and Jinja2 included
# A worker's start, until its ready line, counted apart from any render: the start-up check's 10 s
# (template_source.START_TIME_LIMIT_S), for a busy machine's slow start is no template's doing.
START_LIMIT_S = 10.0
WORKERS = 2
READY = b'{"ready": true}\n'  # the worker's first line: it is listening for jobs


class TemplateFailed(Exception):
    """The template raised, or exceeded a bound; the message is one line for the caller, `field` the
    request field at fault: the template, or the whole chat when the rendered prompt is too long
    (which the messages' length can cause as well as the template)."""

    def __init__(self, message: str, field: str = "chat.chat_template") -> None:
        super().__init__(message)
        self.field = field


class TemplateWorkerUnavailable(TemplateFailed):
    """No worker could take the render: its process did not start within START_LIMIT_S, or could not
    be started. Not the template's fault: chat.py answers UNAVAILABLE (retry), where a template's
    failure is INVALID_ARGUMENT. A TemplateFailed still, so that the start-up check
    (template_source.py), which catches that, refuses in one line rather than with a traceback."""


def spawn_worker(memory_bytes: int) -> subprocess.Popen[bytes]:
    """Starts a worker process (template_worker_main.main()) capped at `memory_bytes` of address space."""
    return subprocess.Popen(
        # -P: the server's working directory does not go on the worker's import path.
        [
            sys.executable,
            "-P",
            "-m",
            "tandem.decoder.engine.admission.template_worker_main",
            str(memory_bytes),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


class TemplateWorkers:
    """Renders templates in worker processes; safe to call from several threads."""

    def __init__(
        self,
        workers: int = WORKERS,
        time_limit_s: float = TIME_LIMIT_S,
        memory_bytes: int = MEMORY_BYTES,
        start_limit_s: float = START_LIMIT_S,
        spawn: Callable[[int], subprocess.Popen[bytes]] = spawn_worker,  # tests slow a start with it
    ) -> None:
        self.time_limit_s = time_limit_s
        self.memory_bytes = memory_bytes
        self.start_limit_s = start_limit_s
        self._spawn = spawn
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        weakref.finalize(self, _kill_all, self._all)  # workers of a dropped object end with it
        # Each slot holds a started worker (ready, or starting while the caller's work goes on), or
        # None where a start failed: the next caller then starts one.
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(self._replace(None))

    def render(
        self,
        source: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        variables: dict[str, Any],
        time_limit_s: float | None = None,  # None: the workers' limit, what a request's render gets
    ) -> str:
        """The rendered text. Raises TemplateFailed (a template error or a bound exceeded), or its
        subclass TemplateWorkerUnavailable.

        A render at start (chat.py's end-of-turn probe) passes a longer `time_limit_s`: it is the
        template's first compile, on a machine still loading the model, and what it derives holds
        for every chat after."""
        request = {
            "source": source,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "variables": variables,
        }
        return self._call(request, time_limit_s)["text"]

    def compile(self, source: str) -> None:
        """Compiles `source` and renders nothing, so that a template no chat could use is found before
        one is asked for. Raises TemplateFailed: Jinja's message and line ("the template does not
        compile: line 3: ..."), or a bound exceeded (Jinja folds constant expressions while
        compiling); or its subclass TemplateWorkerUnavailable."""
        self._call({"source": source})

    def _call(self, request: dict[str, Any], time_limit_s: float | None = None) -> dict[str, Any]:
        line = (json.dumps(request, ensure_ascii=False) + "\n").encode()
        worker = self._idle.get()
        try:
            if worker is None or not worker.is_alive():  # a start that failed, or one that died idle
                if worker is not None:
                    worker.kill()
                worker = self._start()
            worker.wait_ready(self.start_limit_s)  # not the template's time: its limit starts after
            reply = worker.call(line, self.time_limit_s if time_limit_s is None else time_limit_s)
            if reply.get("retiring"):
                # It answered and is ending (out of memory): a render handed to it now would find
                # its pipe closed. (Another caller's chat failed that way, "worker ended (exit 0)",
                # right after an 'a' * 10**9 template.)
                worker = self._replace(worker)
        except _WorkerNotStarted as error:
            worker = self._replace(worker)
            raise TemplateWorkerUnavailable(str(error)) from None
        except _WorkerLost as lost:
            worker = self._replace(worker)  # killed, or it died: its successor starts now
            raise TemplateFailed(str(lost)) from None
        finally:
            self._idle.put(worker)
        if "error" in reply:
            raise TemplateFailed(reply["error"], reply.get("field", "chat.chat_template"))
        return reply

    def _replace(self, worker: _Worker | None) -> _Worker | None:
        """Ends `worker` and starts its successor now, so that its start overlaps whatever comes
        before the slot's next render. None where none can start (shut down, or no process)."""
        if worker is not None:
            worker.kill()
        try:
            return self._start()
        except (_WorkerLost, _WorkerNotStarted):
            return None

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise _WorkerLost("the template workers are shut down")
            try:
                process = self._spawn(self.memory_bytes)
            except OSError as error:  # no process to be had (fork refused: out of memory or PIDs)
                raise _WorkerNotStarted(f"the template worker could not be started ({error})") from None
            worker = _Worker(process, self.memory_bytes)
            self._all[:] = [w for w in self._all if w.is_alive()] + [worker]
            return worker

    def close(self) -> None:
        """Stops every worker (idempotent); a render after it fails naming the shutdown."""
        with self._lock:
            self._closed = True
            _kill_all(self._all)


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


class _WorkerLost(Exception):
    pass


class _WorkerNotStarted(Exception):
    pass


class _TimedOut(Exception):
    pass


class _Ended(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: subprocess.Popen[bytes], memory_bytes: int) -> None:
        self.process = process
        self.memory_bytes = memory_bytes
        self.is_ready = False  # its ready line has been read
        self._buffer = b""

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, start_limit_s: float) -> None:
        """Returns once the worker has said it is ready, or kills it and raises _WorkerNotStarted."""
        if self.is_ready:
            return
        try:
            line = self._read_line(time.monotonic() + start_limit_s) + b"\n"
        except _TimedOut:
            self.kill()
            raise _WorkerNotStarted(
                f"the template worker did not start within {start_limit_s:g} s (a busy machine)"
            ) from None
        except _Ended as ended:
            raise _WorkerNotStarted(f"the template worker ended at its start (exit {ended.code})") from None
        if line != READY:
            self.kill()
            raise _WorkerNotStarted("the template worker started without saying it was ready")
        self.is_ready = True

    def call(self, line: bytes, time_limit_s: float) -> dict[str, Any]:
        # The worker is ready, so from here on only the template runs against the limit.
        deadline = time.monotonic() + time_limit_s
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(line)
            self.process.stdin.flush()
            return json.loads(self._read_line(deadline))
        except (OSError, ValueError) as error:  # a broken pipe, or a reply cut short by a crash
            self.kill()
            raise _WorkerLost(f"the template's worker failed ({error.__class__.__name__})") from None
        except _TimedOut:
            self.kill()
            raise _WorkerLost(f"the template ran longer than {time_limit_s:g} s") from None
        except _Ended as ended:
            raise _WorkerLost(
                f"the template's worker ended (exit {ended.code}): more than "
                f"{self.memory_bytes >> 20} MiB of memory, or a crash"
            ) from None

    def _read_line(self, deadline: float) -> bytes:
        """The next line; raises _TimedOut at `deadline`, _Ended (the process reaped) at its end."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise _TimedOut
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.kill()
                raise _Ended(self.process.returncode)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
