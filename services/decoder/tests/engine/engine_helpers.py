"""Running an in-process engine in tests: concurrent submission, reading its events, and where its
grammars' masks are computed."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished


def tokens(events: Iterable[Event]) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def finished(events: list[Event]) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def run_concurrently(engine: Engine, specs: list[GenerateSpec]) -> list[list[Event]]:
    """Submit every spec before the engine takes its next step, then wait for all.

    The loop checks for work under its wake-up condition; holding it while submitting means the
    first step already sees every request, so none runs alone for a few steps first (which would,
    for example, let it speculate in a test about batches too large to speculate)."""
    results: list[list[Event]] = [[] for _ in specs]
    done = threading.Semaphore(0)

    def on_event_for(i: int):
        def on_event(event: Event) -> None:
            results[i].append(event)
            if isinstance(event, Finished | Failed):
                done.release()

        return on_event

    with engine._thread._wakeup:  # re-entrant: submit's own wake() takes it again
        for i, spec in enumerate(specs):
            engine.submit(spec, on_event_for(i))
    for _ in specs:
        assert done.acquire(timeout=120)
    return results


class RecordingMatcher:
    """An llguidance matcher that records on which thread each of its masks is computed."""

    def __init__(self, matcher: object) -> None:
        self._matcher = matcher
        self.threads: list[str] = []

    def compute_bitmask(self) -> bytes:
        self.threads.append(threading.current_thread().name)
        return self._matcher.compute_bitmask()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._matcher, name)
