"""A Generate stream whose end its observers (the client's span, its duration metric) hear of once.

NOTE: the end is told when the caller reads it, the stream's end (EOF) or its error, before that read
returns. A one-shot command (`tandem generate`) shuts its telemetry down right after: what a task
started from gRPC's done callback recorded ran later, if at all (the span was missing in 3 of 5 runs
until b3c9226, and the duration point the same way). gRPC's done callback tells the rest: a call
cancelled (by its caller, or its task's cancellation), past its deadline, or ended by its channel's
close. It does not tell a call its caller merely stopped reading: gRPC completes a stream's status only
once its messages are read, so such a call stays open, its server generating, until its deadline or
its channel's close (grpc.aio's own cancel of a collected call never comes: its pending status holds
it). A stream its caller drops, unended, therefore cancels its call (`_cancel_dropped`): its observers
are told CANCELLED, and the server stops.

OpenTelemetry-free, as the client is: the observers are the telemetry's. An observer that raises (its
exporter's fault) neither keeps the others from hearing nor turns the caller's read into its error. Its
traceback is logged once a process for its class, its later failures counted (`observer_failures`) and
logged at DEBUG once a stream: once a stream, a broken exporter logged 10,000 tracebacks for 10,000
streams (5.95 MB), and before that once a response (301 KB for a stream of 1,000). A cancellation or an
interrupt (a BaseException) raised by one is raised out of the read after the others have heard: it
skipped them, their span never ended. An interrupt or an exit wins over a cancellation: the first raised
was, and an earlier observer's CancelledError hid a later one's KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

log = logging.getLogger(__name__)

# Each observer class's failures (Exceptions raised) in this process: its first is logged with its
# traceback (the observers are new for each stream, their class the same).
observer_failures: collections.Counter[type] = collections.Counter()


class StreamObserver(Protocol):
    """What one part of the client's telemetry records of a stream."""

    def on_response(self, response: Any) -> None:
        """Each response, as the caller reads it."""

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        """The call's end, once: the code its caller gets."""


class _Ending:
    """The observers, which it tells of each response and the end, and whether they have heard the end:
    shared by the stream and gRPC's done callback, which must not hold the stream (it would never be
    dropped)."""

    def __init__(self, observers: Sequence[StreamObserver]) -> None:
        self.observers = tuple(observers)
        self.is_ended = False
        self._failed: set[int] = set()  # the observers (by position) that have failed on this stream

    def respond(self, response: Any) -> None:
        self._tell_all(lambda observer: observer.on_response(response))

    def end(self, code: grpc.StatusCode, details: str | None) -> None:
        if self.is_ended:
            return
        self.is_ended = True
        self._tell_all(lambda observer: observer.on_end(code, details))

    def _tell_all(self, tell: Callable[[StreamObserver], None]) -> None:
        """`tell` each observer: an Exception logged (`_failed_on`), a BaseException raised once every
        observer has been told, one not a cancellation where any was."""
        raised: BaseException | None = None
        for i, observer in enumerate(self.observers):
            try:
                tell(observer)
            except Exception as error:
                self._failed_on(i, observer, error)
            except BaseException as error:
                if raised is None or (
                    isinstance(raised, asyncio.CancelledError)
                    and not isinstance(error, asyncio.CancelledError)
                ):
                    raised = error
        if raised is not None:
            raise raised

    def _failed_on(self, i: int, observer: StreamObserver, error: Exception) -> None:
        """Observer `i`'s failure logged: with its traceback the first time its class fails in this
        process, at DEBUG the first time it fails on this stream, else counted alone."""
        kind = type(observer)
        observer_failures[kind] += 1
        if observer_failures[kind] == 1:
            log.error(
                "stream observer %s failed (its later failures are counted, logged at DEBUG once a stream)",
                kind.__qualname__,
                exc_info=error,
            )
        elif i not in self._failed:
            log.debug(
                "stream observer %s failed again (%d failures in this process): %r",
                kind.__qualname__,
                observer_failures[kind],
                error,
            )
        self._failed.add(i)

    def on_done(self, call: grpc.aio.Call) -> None:
        if self.is_ended:  # read() saw the end first
            return

        async def end() -> None:
            self.end(await call.code(), await call.details())

        _pending.add(task := asyncio.get_running_loop().create_task(end()))
        task.add_done_callback(_pending.discard)


class ObservedStream:
    """A server-streaming call whose responses and end go to `observers`; everything else is the call.
    Its caller keeps it while it wants the call: dropped unended, its call is cancelled (the NOTE)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, observers: Sequence[StreamObserver]) -> None:
        self._call = call
        self._ending = _Ending(observers)
        call.add_done_callback(self._ending.on_done)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # started outside the loop (grpc.aio takes the channel's): left uncancelled
            return
        # Not at exit: the loop is gone by then, and the channel's close ends the call.
        weakref.finalize(self, _cancel_dropped, loop, call).atexit = False

    def __getattr__(self, name: str) -> Any:  # cancel(), done(), time_remaining(), ...
        return getattr(self._call, name)

    # The call's awaitables, each awaited here, not handed out: `await client.generate(r).code()` keeps
    # no other reference to the stream, and a coroutine of the call's own would let it be dropped, and
    # the call cancelled (the NOTE), before the status it waits for.
    async def code(self) -> grpc.StatusCode:
        return await self._call.code()

    async def details(self) -> str:
        return await self._call.details()

    async def initial_metadata(self) -> Any:
        return await self._call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        return await self._call.trailing_metadata()

    async def wait_for_connection(self) -> None:
        await self._call.wait_for_connection()

    def __aiter__(self) -> ObservedStream:
        return self

    async def __anext__(self) -> Any:
        response = await self.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    async def read(self) -> Any:
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            self._ending.end(error.code(), error.details())
            raise
        if response is grpc.aio.EOF:
            self._ending.end(await self._call.code(), await self._call.details())
        else:
            self._ending.respond(response)
        return response


def _cancel_dropped(loop: asyncio.AbstractEventLoop, call: grpc.aio.Call) -> None:
    """A dropped stream's call cancelled on its own loop: the collector may drop the stream on another
    thread, and grpc.aio's call is the loop's alone (its cancel sets the loop's futures)."""
    try:
        loop.call_soon_threadsafe(call.cancel)  # a no-op for a call already done
    except RuntimeError:  # the loop is closed, and the call's channel with it
        pass


_pending: set[asyncio.Task] = set()  # end-telling tasks, held until done so they are not collected
