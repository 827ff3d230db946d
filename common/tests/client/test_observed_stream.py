"""A stream's observers hear of its end once, by the time its caller has read the end or caught its
error: a one-shot command (`tandem generate`) shuts its telemetry down right after, and what a task of
gRPC's done callback recorded later was lost (the Generate duration point in 1 of 40 runs here, the span
in 3 of 5 `tandem generate` runs). A call its caller cancels is still told, by the done callback, and a
stream its caller drops unended is cancelled, so that it is told too (and its server stops)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from common.tests.client.replica import Refusing, Replica, serve_decoder
from tandem.client import telemetry as otel
from tandem.client.client import DecoderClient
from tandem.client.observed_stream import ObservedStream, observer_failures
from tandem.client.pb.tandem.v1 import decoder_pb2


class _Endless(Replica):
    """Streams until cancelled, and says when it was."""

    def __init__(self) -> None:
        super().__init__("endless")
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):  # type: ignore[override]
        try:
            while True:
                yield decoder_pb2.GenerateResponse(
                    request_id=self.name, accepted=decoder_pb2.PromptAccepted()
                )
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


class _Call:
    """A finished call whose done callback has not run yet (it runs when the test says)."""

    def __init__(self, responses: list[object], error: grpc.aio.AioRpcError | None = None) -> None:
        self._responses = responses
        self._error = error
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def cancel(self) -> bool:
        return False  # finished already

    async def read(self) -> object:
        if self._responses:
            return self._responses.pop(0)
        if self._error is not None:
            raise self._error
        return grpc.aio.EOF

    async def code(self) -> grpc.StatusCode:
        return self._error.code() if self._error is not None else grpc.StatusCode.OK

    async def details(self) -> str | None:
        return self._error.details() if self._error is not None else None


class _Observer:
    def __init__(self) -> None:
        self.responses: list[object] = []
        self.ends: list[tuple[grpc.StatusCode, str | None]] = []

    def on_response(self, response: object) -> None:
        self.responses.append(response)

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        self.ends.append((code, details))


async def test_the_end_is_told_before_the_read_of_eof_returns_and_not_again_by_the_done_callback() -> None:
    call, observer = _Call(["a", "b"]), _Observer()
    stream = ObservedStream(call, [observer])  # type: ignore[arg-type]
    assert [r async for r in stream] == ["a", "b"]
    assert (observer.responses, observer.ends) == (["a", "b"], [(grpc.StatusCode.OK, None)])
    call.callbacks[0](call)
    await asyncio.sleep(0)
    assert observer.ends == [(grpc.StatusCode.OK, None)]


async def test_the_end_is_told_before_the_read_of_the_error_raises() -> None:
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), "prompt: empty"
    )
    call, observer = _Call([], error), _Observer()
    with pytest.raises(grpc.aio.AioRpcError):
        await ObservedStream(call, [observer]).read()  # type: ignore[arg-type]
    assert observer.ends == [(grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")]


class _Failing:
    """An observer whose every hook raises `failure`, as a span whose exporter fails."""

    def __init__(self, failure: type[BaseException] = RuntimeError) -> None:
        self.failure = failure

    def on_response(self, response: object) -> None:
        raise self.failure("an observer failed")

    def on_end(self, code: grpc.StatusCode, details: str | None) -> None:
        raise self.failure("an observer failed")


def _failing_kind() -> type[_Failing]:
    """An observer class that has not failed in this process yet (its first failure is the one logged)."""

    class Failing(_Failing):
        pass

    return Failing


async def test_an_observer_that_raises_leaves_the_others_told_and_the_reads_their_own() -> None:
    # It was raised out of the caller's read, in place of the response or the end, and the observers
    # after it never heard them: a span's exporter failing lost the caller's stream and its duration.
    call, observer = _Call(["a"]), _Observer()
    stream = ObservedStream(call, [_Failing(), observer])  # type: ignore[arg-type]
    assert [r async for r in stream] == ["a"]
    assert (observer.responses, observer.ends) == (["a"], [(grpc.StatusCode.OK, None)])


async def test_an_observer_class_that_fails_on_every_stream_is_logged_once_a_process_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Each failure logged its traceback (301 KB of log for a stream of 1,000 responses), then each
    # stream's first: 10,000 tracebacks, 5.95 MB, for 10,000 streams of a broken exporter.
    broken, other = _failing_kind(), _failing_kind()
    with caplog.at_level(logging.DEBUG, logger="tandem.client.observed_stream"):
        for _ in range(100):
            stream = ObservedStream(_Call(["a"] * 3), [broken(), other(), _Observer()])  # type: ignore[arg-type]
            assert len([r async for r in stream]) == 3
    tracebacks = [record for record in caplog.records if record.exc_info is not None]
    assert [record.levelno for record in tracebacks] == [logging.ERROR] * 2  # one a class
    assert len(caplog.records) - len(tracebacks) == 2 * 99  # at DEBUG, once a stream after the first
    assert (observer_failures[broken], observer_failures[other]) == (100 * 4, 100 * 4)  # 3 responses, end


@pytest.mark.parametrize("failure", [asyncio.CancelledError, KeyboardInterrupt])
async def test_a_cancellation_an_observer_raises_comes_out_of_the_read_after_the_others_have_heard(
    failure: type[BaseException],
) -> None:
    # It skipped the observers after it: their spans never ended, their durations never recorded.
    call, observer = _Call(["a"]), _Observer()
    stream = ObservedStream(call, [_Failing(failure), observer])  # type: ignore[arg-type]
    with pytest.raises(failure):
        await stream.read()
    assert observer.responses == ["a"]
    with pytest.raises(failure):
        await stream.read()
    assert observer.ends == [(grpc.StatusCode.OK, None)]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("is_interrupt_first", [False, True])
async def test_an_interrupt_an_observer_raises_wins_over_a_cancellation_another_raises(
    interrupt: type[BaseException], is_interrupt_first: bool
) -> None:
    # The first raised was: an earlier observer's CancelledError hid a later one's KeyboardInterrupt.
    failing = [_Failing(asyncio.CancelledError), _Failing(interrupt)]
    call, observer = _Call([]), _Observer()
    stream = ObservedStream(call, [*failing[:: -1 if is_interrupt_first else 1], observer])  # type: ignore[arg-type]
    with pytest.raises(interrupt):
        await stream.read()
    assert observer.ends == [(grpc.StatusCode.OK, None)]


async def test_a_call_left_unread_is_told_its_end_by_the_done_callback() -> None:
    call, observer = _Call(["a"]), _Observer()
    ObservedStream(call, [observer])  # type: ignore[arg-type]
    call.callbacks[0](call)
    await asyncio.sleep(0)
    assert observer.ends == [(grpc.StatusCode.OK, None)]


def _durations(reader: InMemoryMetricReader) -> list[tuple[dict, int]]:
    """Each (attributes, count) of gen_ai.client.operation.duration collected now."""
    data = reader.get_metrics_data()  # None before the first point
    if data is None:
        return []
    return [
        (dict(point.attributes), point.count)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == otel.GEN_AI_CLIENT_OPERATION_DURATION
        for point in metric.data.data_points
    ]


async def _generate_to_its_end(replica: Replica) -> list[tuple[dict, int]]:
    """Reads one Generate stream to its end or error, then collects at once, as a command's exit does."""
    reader = InMemoryMetricReader()
    telemetry = otel.build_telemetry("test-client", metric_readers=[reader], shutdown_on_exit=False)
    server = await serve_decoder(replica)
    try:
        async with DecoderClient(server.address, telemetry=telemetry, is_health_checked=False) as client:
            with (
                pytest.raises(grpc.aio.AioRpcError)
                if isinstance(replica, Refusing)
                else contextlib.nullcontext()
            ):
                async for _ in client.generate(decoder_pb2.GenerateRequest(), timeout=10):
                    pass
            return _durations(reader)  # no await since the stream's end: no callback has run
    finally:
        await server.stop(0)
        telemetry.shutdown()


@pytest.mark.parametrize("attempt", range(20))  # the done callback's timing varies: 1 of 40 lost it
async def test_a_stream_read_to_its_end_has_recorded_its_duration_once(attempt: int) -> None:
    ((attributes, count),) = await _generate_to_its_end(Replica("a"))
    assert count == 1
    assert attributes[otel.GEN_AI_OPERATION_NAME] == otel.OPERATION_TEXT_COMPLETION
    assert otel.ERROR_TYPE not in attributes


async def test_a_stream_that_fails_has_recorded_its_duration_with_its_error_type() -> None:
    ((attributes, count),) = await _generate_to_its_end(Refusing("a"))
    assert (attributes[otel.ERROR_TYPE], count) == ("INVALID_ARGUMENT", 1)


async def test_a_stream_its_caller_cancels_unread_is_recorded_once_by_the_done_callback() -> None:
    reader = InMemoryMetricReader()
    telemetry = otel.build_telemetry("test-client", metric_readers=[reader], shutdown_on_exit=False)
    server = await serve_decoder(Replica("a"))
    try:
        async with DecoderClient(server.address, telemetry=telemetry, is_health_checked=False) as client:
            call = client.generate(decoder_pb2.GenerateRequest(), timeout=10)
            call.cancel()
            async with asyncio.timeout(5):
                while not _durations(reader):
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # a second point, had there been one, would be in by now
            ((attributes, count),) = _durations(reader)
    finally:
        await server.stop(0)
        telemetry.shutdown()
    assert (attributes[otel.ERROR_TYPE], count) == ("CANCELLED", 1)


async def test_a_stream_its_caller_drops_unended_is_cancelled_and_recorded_once() -> None:
    # Left after one response, not cancelled: gRPC gives no status to a stream nobody reads, so its span
    # and duration never ended and its server went on generating until the channel closed.
    reader = InMemoryMetricReader()
    telemetry = otel.build_telemetry("test-client", metric_readers=[reader], shutdown_on_exit=False)
    replica = _Endless()
    server = await serve_decoder(replica)
    try:
        async with DecoderClient(server.address, telemetry=telemetry, is_health_checked=False) as client:
            async for _ in client.generate(decoder_pb2.GenerateRequest(), timeout=10):
                break
            # Never, before the fix; 2 s timed out once on a host at load 4.5 (two workers and helpers).
            async with asyncio.timeout(10):
                await replica.cancelled.wait()
                while not _durations(reader):
                    await asyncio.sleep(0.005)
            ((attributes, count),) = _durations(reader)
    finally:
        await server.stop(0)
        telemetry.shutdown()
    assert (attributes[otel.ERROR_TYPE], count) == ("CANCELLED", 1)


async def test_a_status_awaited_on_a_stream_held_by_no_one_else_is_the_calls_own() -> None:
    # `await client.generate(r).code()` keeps no reference to the stream but the awaited coroutine's:
    # the call's own coroutine let the stream be dropped, and its call cancelled, before the status came.
    telemetry = otel.build_telemetry(
        "test-client", metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False
    )
    server = await serve_decoder(Refusing("a"))
    try:
        async with DecoderClient(server.address, telemetry=telemetry, is_health_checked=False) as client:
            code = await client.generate(decoder_pb2.GenerateRequest(), timeout=10).code()
    finally:
        await server.stop(0)
        telemetry.shutdown()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
