"""How a client command (`tandem generate`, `chat`, `embed`) says that a call failed: one line on
stderr, naming the flag to change, and an exit code; never a traceback.

A server names the request field it refuses (`stopping.max_new_tokens: must be >= 1, got 0`, with a
`BadRequest` field violation); a command knows which of its flags set that field, so the line names
the flag (`--max-tokens (TANDEM_GENERATE_MAX_TOKENS): must be >= 1, got 0`) and exits 2, as a flag
the command itself refuses does. A server that cannot be reached (or is still loading) is the flag of
its address, `--address` or `--encoder-address`, and so is a server that serves another service (the
encoder's address given as the decoder's: gRPC's bare "UNIMPLEMENTED: Method not found!"), exit 2.
Anything else is the status as the server said it, exit 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import grpc

from tandem.client.status import field_violation

EXIT_FLAG = 2  # a flag's value is wrong: change it (click's usage errors exit 2 too)
EXIT_FAILED = 1  # the call failed for another reason


@dataclass(frozen=True)
class CallFlags:
    """The flags behind one call, for naming them in its errors."""

    address: str  # the flag naming the server called, with its value: "--address 127.0.0.1:50052"
    fields: Mapping[str, str]  # a request field (or a prefix of it) -> the flag that set it
    service: str = ""  # the service called, "tandem.v1.Decoder": named when the address serves none


# Which server an address serving the other service likely is.
_OTHER_SERVER = {"tandem.v1.Decoder": "the encoder", "tandem.v1.Encoder": "the decoder"}


def failure(error: grpc.aio.AioRpcError, flags: CallFlags) -> tuple[str, int]:
    """The line to print for `error` (after the command's name) and the exit code."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"{flags.address}: UNAVAILABLE: {details} (`tandem wait` waits until it serves)",
            EXIT_FAILED,
        )
    if code == grpc.StatusCode.UNIMPLEMENTED and flags.service and details.startswith("Method not found"):
        other = _OTHER_SERVER.get(flags.service)
        guess = f" (is it {other}?)" if other else ""
        return f"{flags.address} does not serve {flags.service}{guess}: {code.name}: {details}", EXIT_FLAG
    if code == grpc.StatusCode.NOT_FOUND and details.startswith("adapter ") and "adapter" in flags.fields:
        # The decoder names no field for an adapter it has not loaded (NotFound): its words say which.
        return f"{flags.fields['adapter']}: {details}", EXIT_FLAG
    violation = field_violation(error)
    if violation is not None and code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        field, description = violation
        flag = flag_of(field, flags.fields)
        if flag is not None:
            return f"{flag}: {description} (the request's {field})", EXIT_FLAG
    return f"{code.name}: {details}", EXIT_FAILED


class AnswerLost(Exception):
    """Standard output refused a write of the answer; not an OSError, so that no handler of a file's
    errors takes it for its own."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class _Answers:
    """Standard output, its write errors raised as AnswerLost."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise AnswerLost(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise AnswerLost(error) from None

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding: the stream's own
        return getattr(self._stream, name)


def answering(prog: str, run: Callable[[], int]) -> int:
    """`run()`'s exit code, the answer it prints going to standard output, and flushed there. Where it
    cannot go, one line on stderr and EXIT_FAILED: a closed stdout (`>&-`: print wrote nowhere and the
    exit was 0) or a refused write (`>/dev/full`: an ENOSPC traceback). A reader that left (EPIPE,
    `| head -1`) gets no line, as `up` reads it (up_processes._write): nobody is there to read it."""
    if sys.stdout is None:
        print(f"{prog}: standard output is closed: nowhere to write the answer", file=sys.stderr)
        return EXIT_FAILED
    answers = _Answers(sys.stdout)
    try:
        with contextlib.redirect_stdout(answers):  # type: ignore[type-var]
            code = run()
            answers.flush()
        return code
    except AnswerLost as lost:
        _discard(sys.stdout)
        if not isinstance(lost.error, BrokenPipeError):
            print(f"{prog}: cannot write the answer to standard output: {lost}", file=sys.stderr)
        return EXIT_FAILED


def _discard(stream: TextIO) -> None:
    """What is still buffered of `stream`, and later writes, to /dev/null: Python's flush at exit would
    otherwise fail again and say so in its own words ("Exception ignored ...")."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: no descriptor (a test's capture)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def flag_of(field: str, fields: Mapping[str, str]) -> str | None:
    """The flag of the longest key of `fields` that is `field` or a path above it (`prompt[2]` is
    above `prompt[2].embeddings.shape`, `structured` above `structured.regex`)."""
    best = None
    for key in fields:
        if field == key or field.startswith((key + ".", key + "[")):
            if best is None or len(key) > len(best):
                best = key
    return None if best is None else fields[best]
