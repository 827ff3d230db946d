"""A caller's request ID is a label: echoed, never looked up, so no caller's ID reaches another's request.

The engine keys each request by a name of its own; these tests reuse and share caller IDs the ways
careless and hostile callers do, and compare every request's tokens with the same request run alone
under an ID nobody else uses.
"""

from __future__ import annotations

import re
import threading

from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.outputs.outputs import Accepted, Delta, Event, Failed, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams

from .test_engine import _engine, _run_concurrently, _tokens

_STOPPING = StoppingParams(max_new_tokens=8, ignore_eos=True)


def _spec(request_id: str, sampling: SamplingParams, prompt: list[int] | None = None) -> GenerateSpec:
    return GenerateSpec([prompt or [5, 6, 7]], sampling, _STOPPING, request_id=request_id)


def test_reusing_a_finished_requests_id_never_inherits_its_sampling(tiny_model_dir, tiny_fp32) -> None:
    # Keyed by the caller's ID, the sampler reused the previous request's batch: the seeded request
    # below came out greedy, as the request before it under the same ID had asked.
    seeded = SamplingParams(temperature=1.0, seed=3)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        baseline = _tokens(engine.generate(_spec("fresh", seeded)))
        greedy = _tokens(engine.generate(_spec("same", SamplingParams(temperature=0.0))))
        reused = _tokens(engine.generate(_spec("same", seeded)))
    assert reused == baseline
    assert greedy != baseline  # the two are told apart at all


def test_two_live_requests_may_carry_the_same_id_and_each_gets_its_own_tokens(
    tiny_model_dir, tiny_fp32
) -> None:
    specs = [
        _spec("shared", SamplingParams(temperature=0.0), [5, 6, 7]),
        _spec("shared", SamplingParams(temperature=0.9, seed=1), [9, 10, 11, 12]),
    ]
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        alone = [
            _tokens(engine.generate(_spec(f"alone-{i}", s.sampling, s.prompt[0])))
            for i, s in enumerate(specs)
        ]
        together = _run_concurrently(engine, specs)
    for expected, events in zip(alone, together, strict=True):
        assert {e.request_id for e in events} == {"shared"}  # echoed, never refused as "in use"
        assert _tokens(events) == expected


def test_an_assigned_id_is_random_and_says_nothing_about_other_requests(tiny_model_dir, tiny_fp32) -> None:
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        ids = [
            next(iter(engine.generate(_spec("", SamplingParams(temperature=0.0))))).request_id
            for _ in range(3)
        ]
        # A caller naming its requests like the assigned ones changes nothing for anonymous callers.
        squatted = [_spec(f"req-{i}", SamplingParams(temperature=0.0)) for i in range(8)]
        _run_concurrently(engine, squatted + [_spec("", SamplingParams(temperature=0.0))])
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == 3


class _Gate:
    """An event callback that holds the engine thread inside its first event, until `release()`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Delta) and not self.entered.is_set():
            self.entered.set()
            assert self._released.wait(30)
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    def release(self) -> None:
        self._released.set()


def _collect() -> tuple[list[Event], threading.Event, object]:
    events: list[Event] = []
    done = threading.Event()

    def on_event(event: Event) -> None:
        events.append(event)
        if isinstance(event, Finished | Failed):
            done.set()

    return events, done, on_event


def test_a_cancelled_requests_id_is_free_at_once_and_its_abort_hits_only_it(
    tiny_model_dir, tiny_fp32
) -> None:
    # An abort is applied at the next step. Applied by the caller's ID, it removed whatever held that
    # ID by then: a new stream reusing the ID right after a cancel got `accepted` and then nothing.
    # The engine thread is held between two steps while the caller cancels and reuses the ID.
    greedy = SamplingParams(temperature=0.0)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        baseline = _tokens(engine.generate(_spec("baseline", greedy)))
        gate = _Gate()
        engine.submit(GenerateSpec([[1, 2]], greedy, _STOPPING, request_id="gate"), gate)
        assert gate.entered.wait(30)  # the engine thread now waits inside the gate's callback
        cancelled_key = engine.submit(_spec("reused", greedy), lambda event: None)
        engine.abort(cancelled_key)  # the stream's caller cancels...
        events, done, on_event = _collect()
        engine.submit(_spec("reused", greedy), on_event)  # ...and reuses the ID before the next step
        gate.release()
        assert done.wait(60) and gate.done.wait(60)
        assert isinstance(events[0], Accepted) and isinstance(events[-1], Finished)
        assert _tokens(events) == baseline
        assert engine.core.num_live() == 0


def test_an_abort_after_the_request_ended_touches_nothing(tiny_model_dir, tiny_fp32) -> None:
    greedy = SamplingParams(temperature=0.0)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        events, done, on_event = _collect()
        key = engine.submit(_spec("x", greedy), on_event)
        assert done.wait(60)
        later, later_done, later_on_event = _collect()
        engine.submit(_spec("x", greedy), later_on_event)
        engine.abort(key)  # a stale abort of the first: the second, under the same ID, runs on
        assert later_done.wait(60)
    assert isinstance(later[-1], Finished) and _tokens(later) == _tokens(events)
