"""A Generate stream whose end its observers (the client's span, its duration metric) hear of once.

NOTE: the end is told when the caller reads it, the stream's end (EOF) or its error, before that read
returns. A one-shot command (`tandem generate`) shuts its telemetry down right after: what a task
started from gRPC's done callback recorded ran later, if at all (the span was missing in 3 of 5 runs
until b3c9226, and the duration point the same way). The done callback tells the end only of a call
its caller stopped reading (cancelled, or left before its end).

OpenTelemetry-free, as the client is: the observers are the telemetry's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import grpc


class StreamObserver(Protocol):
    """What one part of the client's telemetry records of a stream."""

    def on_response(self, response: Any) -> None:
        """Each response, as the caller reads it."""

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        """The call's end, once: the code its caller gets."""


class ObservedStream:
    """A server-streaming call whose responses and end go to `observers`; everything else is the call."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, observers: Sequence[StreamObserver]) -> None:
        self._call = call
        self._observers = tuple(observers)
        self._is_ended = False
        call.add_done_callback(self._on_done)

    def __getattr__(self, name: str) -> Any:  # cancel(), code(), details(), ...
        return getattr(self._call, name)

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
            self._end(error.code(), error.details())
            raise
        if response is grpc.aio.EOF:
            self._end(await self._call.code(), await self._call.details())
        else:
            for observer in self._observers:
                observer.on_response(response)
        return response

    def _end(self, code: grpc.StatusCode, details: str | None) -> None:
        if self._is_ended:
            return
        self._is_ended = True
        for observer in self._observers:
            observer.on_end(code, details)

    def _on_done(self, call: grpc.aio.Call) -> None:
        if self._is_ended:  # read() saw the end first
            return

        async def end() -> None:
            self._end(await call.code(), await call.details())

        _pending.add(task := asyncio.get_running_loop().create_task(end()))
        task.add_done_callback(_pending.discard)


_pending: set[asyncio.Task] = set()  # end-telling tasks, held until done so they are not collected
