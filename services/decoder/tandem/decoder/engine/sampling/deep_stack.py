"""Work run on a thread of a deep stack of its own: llguidance compiles a grammar recursively.

llguidance compiles and validates a grammar recursively, about 3 KB of stack per level of rules that
name the next: within structured.MAX_SOURCE_CHARS a Lark chain (`b: "a" c`) reaches 5,580 levels and
a JSON schema's $ref chain 1,716, and either overflowed a thread's default 8 MiB stack, which killed
the whole decoder with SIGSEGV. Matching does not recurse per level of nesting (constraint.py): only
compiling, and a matcher's rebuild (which compiles), runs here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

# About 4 times what the deepest 64 KiB source needs; only the pages it touches take memory.
COMPILE_STACK_BYTES = 64 * 1024 * 1024
_STACK_SIZE = threading.Lock()  # threading.stack_size is process-wide: one setter at a time

T = TypeVar("T")


def on_deep_stack(work: Callable[[], T], stack_bytes: int = COMPILE_STACK_BYTES) -> T:
    """`work()` run on a fresh thread of `stack_bytes` stack, its result or exception returned or
    raised here. The thread ends with it: none is kept between compilations."""
    result: Future[T] = Future()

    def run() -> None:
        try:
            result.set_result(work())
        except BaseException as e:  # handed to the caller, which raises it
            result.set_exception(e)

    with _STACK_SIZE:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="tandem-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    return result.result()
