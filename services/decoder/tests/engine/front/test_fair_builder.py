"""The request-building threads take the callers in turn: one caller alone is served in arrival order,
a caller's burst holds a neighbour back by one job per caller in front of it, and a job cancelled
while it waits never runs."""

from __future__ import annotations

import threading

import pytest

from tandem.decoder.engine.front.fair_builder import FairBuilder


@pytest.fixture
def builder():
    made = FairBuilder(1, "test-builder")
    yield made
    made.shutdown(wait=True, cancel_futures=True)


def _blocked(builder: FairBuilder, caller: str = "blocker") -> threading.Event:
    """The builder's one thread held on a job of `caller` until the event is set."""
    gate, started = threading.Event(), threading.Event()
    builder.submit(caller, lambda: (started.set(), gate.wait(10)))
    assert started.wait(10)
    return gate


def test_one_caller_is_served_in_arrival_order(builder: FairBuilder) -> None:
    ran: list[int] = []
    gate = _blocked(builder, "a")
    futures = [builder.submit("a", ran.append, i) for i in range(5)]
    gate.set()
    for future in futures:
        future.result(10)
    assert ran == [0, 1, 2, 3, 4]


def test_a_burst_holds_a_neighbour_back_by_one_job_per_caller_in_front(builder: FairBuilder) -> None:
    ran: list[str] = []
    gate = _blocked(builder)
    burst = [builder.submit("a", ran.append, f"a{i}") for i in range(4)]
    other = builder.submit("b", ran.append, "b0")
    third = [builder.submit("c", ran.append, f"c{i}") for i in range(2)]
    late = builder.submit("b", ran.append, "b1")
    assert builder.num_waiting() == 8
    gate.set()
    for future in [*burst, other, *third, late]:
        future.result(10)
    assert ran == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "a3"]
    assert builder.num_waiting() == 0


def test_a_caller_through_its_view_gets_results_and_errors_as_from_an_executor(builder: FairBuilder) -> None:
    view = builder.for_caller("a")
    assert view.submit(lambda x, y=0: x + y, 2, y=3).result(10) == 5
    with pytest.raises(ZeroDivisionError):
        view.submit(lambda: 1 / 0).result(10)
    assert builder.submit("b", lambda: threading.current_thread().name).result(10) == "test-builder_0"


def test_a_job_cancelled_while_it_waits_never_runs_and_shutdown_cancels_the_rest() -> None:
    builder = FairBuilder(1, "test-builder")
    ran: list[str] = []
    gate = _blocked(builder)
    cancelled = builder.submit("a", ran.append, "cancelled")
    kept = builder.submit("a", ran.append, "kept")
    assert cancelled.cancel()
    gate.set()
    kept.result(10)
    gate = _blocked(builder)
    dropped = builder.submit("b", ran.append, "dropped")
    builder.shutdown(wait=False, cancel_futures=True)
    gate.set()
    builder.shutdown(wait=True)
    assert ran == ["kept"] and dropped.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        builder.submit("a", ran.append, "late")


def test_every_thread_runs_the_initializer_and_several_take_jobs_at_once() -> None:
    initialized: list[str] = []
    builder = FairBuilder(2, "test-pair", lambda: initialized.append(threading.current_thread().name))
    both = threading.Barrier(2, timeout=10)
    try:
        futures = [builder.submit(caller, both.wait) for caller in ("a", "a")]
        for future in futures:
            future.result(10)  # two jobs of one caller ran together: the barrier needed both
    finally:
        builder.shutdown(wait=True)
    assert sorted(initialized) == ["test-pair_0", "test-pair_1"]
