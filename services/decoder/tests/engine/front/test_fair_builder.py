"""The request-building threads take the callers in turn: one caller alone is served in arrival order,
a caller's burst holds a neighbour back by one job per caller in front of it, and a job cancelled
while it waits never runs."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

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


def test_cancelled_jobs_leave_their_line_at_once_and_cost_their_caller_no_turn(builder: FairBuilder) -> None:
    """A caller whose clients cancel (deadlines, clients gone) spent a turn per dead job: 321 of them
    held its next live request behind every other caller's builds, and its line grew without bound."""
    ran: list[str] = []
    gate = _blocked(builder)
    dead = [builder.submit("a", ran.append, f"dead{i}") for i in range(100)]
    others = [builder.submit("b", ran.append, f"b{i}") for i in range(3)]
    for future in dead:
        assert future.cancel()
    assert builder.num_waiting() == 3
    live = builder.submit("a", ran.append, "a-live")
    gate.set()
    for future in [*others, live]:
        future.result(10)
    assert ran == ["b0", "a-live", "b1", "b2"]


def test_a_thread_that_cannot_start_is_started_with_a_later_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Marked started before it was, a builder whose start failed once served nothing ever after."""
    start = threading.Thread.start
    failures = iter([RuntimeError("can't start new thread")])

    def start_or_fail(thread: threading.Thread) -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    builder = FairBuilder(1, "test-builder")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        builder.submit("a", str, 1)
    assert builder.num_waiting() == 0  # refused, not queued for no thread
    try:
        assert builder.submit("a", str, 2).result(10) == "2"
    finally:
        builder.shutdown(wait=True)


def test_at_interpreter_exit_a_running_job_finishes_and_queued_ones_are_dropped() -> None:
    """Daemon threads were killed mid-job at exit (inside a torch op, the process aborted)."""
    script = """
import threading, time
from tandem.decoder.engine.front.fair_builder import FairBuilder
builder = FairBuilder(1, "exit-test")
started = threading.Event()
builder.submit("a", lambda: (started.set(), time.sleep(0.3), print("finished", flush=True)))
builder.submit("a", print, "queued job ran")
started.wait(10)
builder.shutdown(wait=False)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "finished\n", "")


class _Rows:
    """Stands for a request's rows: something whose lifetime the test can watch."""


def test_a_finished_jobs_arguments_and_result_are_freed_with_its_future(builder: FairBuilder) -> None:
    """A done callback that held the job made job -> future -> callback -> job a cycle: each finished
    request's rows stayed until the cycle collector ran (14 of 40 16 MiB arguments, 224 MiB)."""
    gc.disable()
    try:
        rows = _Rows()
        argument = weakref.ref(rows)
        future = builder.submit("a", lambda given: _Rows(), rows)
        result = weakref.ref(future.result(10))
        del rows, future
        builder.submit("a", int).result(10)  # the thread has moved past the job
        assert argument() is None and result() is None
    finally:
        gc.enable()


def test_a_builder_dropped_without_shutdown_runs_what_it_queued_then_ends_its_threads() -> None:
    builder = FairBuilder(1, "test-dropped")
    threads_before = set(threading.enumerate())
    gate = _blocked(builder)
    queued = builder.submit("a", int, "7")
    started = set(threading.enumerate()) - threads_before
    assert len(started) == 1
    del builder
    gc.collect()
    gate.set()
    assert queued.result(10) == 7  # as ThreadPoolExecutor's queue: run, not cancelled
    for thread in started:
        thread.join(10)
        assert not thread.is_alive()
