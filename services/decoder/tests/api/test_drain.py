"""The decoder's drain: its open streams get the grace, then end ABORTED before gRPC's own cut; the
server's drain notice (calls still taken while health-watching clients move away) falls within the
grace, since a Generate taken after the grace would not be ended by `finish_all` and would run on
until the cut."""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.running_server import DRAIN_NOTICE_S
from tandem.decoder.api.drain import CUT_S, drain


class _Server:
    def __init__(self) -> None:
        self.stops: list[tuple[float | None, float]] = []

    async def stop(self, grace_s: float | None, notice_s: float | None = None) -> None:
        self.stops.append((grace_s, notice_s))


class _Engine:
    def __init__(self) -> None:
        self.finished: list[object] = []

    def finish_all(self, reason: object) -> int:
        self.finished.append(reason)
        return 0


async def test_the_drain_notice_falls_within_a_grace_shorter_than_it() -> None:
    server = _Server()
    await drain(server, _Engine(), grace_s=0.1)  # type: ignore[arg-type]
    assert server.stops == [(0.1 + CUT_S, 0.1)]


async def test_a_long_grace_gives_the_whole_notice() -> None:
    server = _Server()
    await drain(server, _Engine(), grace_s=30)  # type: ignore[arg-type]
    assert server.stops == [(30 + CUT_S, DRAIN_NOTICE_S)]


class _SlowServer(_Server):
    """A stop that outlasts the grace, as one with streams still open does."""

    def __init__(self, stop_s: float, fails: bool = False) -> None:
        super().__init__()
        self.stop_s = stop_s
        self.fails = fails
        self.stopped = False

    async def stop(self, grace_s: float | None, notice_s: float | None = None) -> None:
        await super().stop(grace_s, notice_s)
        await asyncio.sleep(self.stop_s)
        self.stopped = True
        if self.fails:
            raise RuntimeError("the stop failed")


class _FailingEngine(_Engine):
    def finish_all(self, reason: object) -> int:
        super().finish_all(reason)
        raise RuntimeError("finish_all failed")


async def test_a_finish_all_that_raises_still_leaves_the_server_stopped_and_goes_on() -> None:
    """finish_all raising left the server's stop running unawaited: drain's caller went on (releasing
    what the server's handlers use) while the server was still stopping."""
    server = _SlowServer(stop_s=0.2)
    with pytest.raises(RuntimeError, match="finish_all failed"):
        await drain(server, _FailingEngine(), grace_s=0.05)  # type: ignore[arg-type]
    assert server.stopped


async def test_of_a_finish_all_and_a_stop_that_both_raise_finish_alls_goes_on_and_the_stops_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = _SlowServer(stop_s=0.2, fails=True)
    with pytest.raises(RuntimeError, match="finish_all failed"):
        await drain(server, _FailingEngine(), grace_s=0.05)  # type: ignore[arg-type]
    assert server.stopped
    [record] = [r for r in caplog.records if r.name == "tandem.decoder"]
    assert record.levelname == "ERROR" and "the stop failed" in caplog.text


async def test_a_drain_cancelled_during_the_grace_still_leaves_the_server_stopped_and_is_cancelled() -> None:
    """A cancel of the task serving (a test's, or serve run inside another loop) during the grace left
    the stop running unawaited, as finish_all's error did."""
    server = _SlowServer(stop_s=0.3)
    draining = asyncio.create_task(drain(server, _Engine(), grace_s=10))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    draining.cancel()
    with pytest.raises(asyncio.CancelledError):
        await draining
    assert server.stopped
