"""The engine thread: the one thread that runs the engine's torch ops, and the loop that steps the core.

NOTE: one thread. Every torch op of the engine (loading, KV allocation, warmup, steps) runs on this
thread: set-up calls through `run` before `start`, then the loop. On CPU a second thread that once
ran a parallel torch op keeps an OpenMP team that slows the stepping thread's ops by ~50% (measured:
8 ms -> 12 ms per bench-small decode step).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from tandem.client.errors import Unavailable
from tandem.decoder.engine.step.core import EngineCore

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineThread:
    """Runs set-up calls, then the step loop, on one thread; a fault fails every open request."""

    def __init__(self, num_threads: int) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="tandem-engine",
            initializer=_init_engine_thread,
            initargs=(num_threads,),
        )
        self._loop_done: concurrent.futures.Future[None] | None = None  # set by start()
        self._wakeup = threading.Condition()
        self._running = False
        self.error: Exception | None = None  # what ended the loop, if a step failed

    @property
    def is_healthy(self) -> bool:
        return self._running and self.error is None

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` on the engine thread and wait for it: set-up only, before the loop takes the thread."""
        if self._loop_done is not None:
            raise RuntimeError("the engine loop owns the engine thread: set-up calls come before start()")
        return self._executor.submit(fn, *args).result()

    def start(self, core: EngineCore, keepalive_s: float | None) -> None:
        """Step `core` while it has work; idle, send the other ranks a keepalive every `keepalive_s`."""
        self._running = True
        self._loop_done = self._executor.submit(self._loop, core, keepalive_s)

    def wake(self) -> None:
        """New work or an abort: the loop stops waiting."""
        with self._wakeup:
            self._wakeup.notify()

    def stop(self) -> None:
        """End the loop after its current step and release the thread."""
        with self._wakeup:
            self._running = False
            self._wakeup.notify()
        if self._loop_done is not None:
            self._loop_done.result()
        self._executor.shutdown()

    def _loop(self, core: EngineCore, keepalive_s: float | None) -> None:
        peers = core.runner.peers
        while True:
            with self._wakeup:
                if self._running and not core.has_work():
                    self._wakeup.wait(keepalive_s)
                if not self._running:
                    return
            try:
                if core.has_work():
                    core.step()
                elif peers is not None:
                    peers.keepalive()
            except Exception as exc:  # a fault in the model or the engine: fail loudly, never hang
                log.exception("engine step failed; failing every open request")
                self.error = exc
                self._running = False
                core.fail_all(Unavailable(f"the decoder engine failed: {type(exc).__name__}"))
                return


def _init_engine_thread(num_threads: int) -> None:
    # The intra-op thread count is per thread: set it where the work runs.
    torch.set_num_threads(num_threads)
    torch.set_grad_enabled(False)
