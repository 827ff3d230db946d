"""The decoder's drain: its open streams get the grace, then end ABORTED before gRPC's own cut; the
server's drain notice (calls still taken while health-watching clients move away) falls within the
grace, since a Generate taken after the grace would not be ended by `finish_all` and would run on
until the cut."""

from __future__ import annotations

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
