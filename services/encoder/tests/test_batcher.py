"""Concurrent calls gathered into batches: a bounded wait for company, a bounded batch size, each
call's outcome its own, a caller that gives up left out (or marked gone for the worker once its batch
runs), and close ending every call with its error."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.client.errors import Unavailable
from tandem.encoder.batcher import Batcher


class Recorder:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.delay_s = delay_s

    def __call__(self, jobs: Sequence[int], is_gone: object = None) -> list[int | BaseException]:
        self.batches.append(list(jobs))
        time.sleep(self.delay_s)
        return [ValueError(f"job {j} is negative") if j < 0 else j * 10 for j in jobs]


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


async def test_calls_arriving_together_run_as_one_batch(executor: ThreadPoolExecutor) -> None:
    run = Recorder()
    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.05)
    assert await asyncio.gather(*(batcher.submit(i) for i in range(5))) == [0, 10, 20, 30, 40]
    assert run.batches == [[0, 1, 2, 3, 4]]
    batcher.close(lambda: Unavailable("closed"))


async def test_a_batch_never_exceeds_its_size_and_keeps_arrival_order(executor: ThreadPoolExecutor) -> None:
    run = Recorder()
    batcher = Batcher(executor, run, max_batch_size=3, max_wait_s=lambda job: 0.05)
    assert await asyncio.gather(*(batcher.submit(i) for i in range(7))) == [i * 10 for i in range(7)]
    assert run.batches == [[0, 1, 2], [3, 4, 5], [6]]
    batcher.close(lambda: Unavailable("closed"))


async def test_a_lone_call_waits_no_longer_than_the_bound(executor: ThreadPoolExecutor) -> None:
    # Timers on one loop fire in the order of their deadlines, however loaded the machine: the first
    # call's 20 ms wait for company ends before the 200 ms sleep does, so the second call, arriving
    # after that sleep, is in a batch of its own.
    run = Recorder()
    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.02)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.2)
    assert await asyncio.gather(first, batcher.submit(3)) == [10, 30]
    assert run.batches == [[1], [3]]
    batcher.close(lambda: Unavailable("closed"))


async def test_calls_that_arrive_during_a_batch_form_the_next_one(executor: ThreadPoolExecutor) -> None:
    run = Recorder(delay_s=0.1)
    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0.03)  # the first batch is running
    rest = await asyncio.gather(*(batcher.submit(i) for i in range(1, 4)))
    assert await first == 0 and rest == [10, 20, 30]
    assert run.batches == [[0], [1, 2, 3]]
    batcher.close(lambda: Unavailable("closed"))


async def test_one_calls_failure_is_its_own(executor: ThreadPoolExecutor) -> None:
    batcher = Batcher(executor, Recorder(), max_batch_size=8, max_wait_s=lambda job: 0.02)
    results = await asyncio.gather(
        batcher.submit(1), batcher.submit(-1), batcher.submit(2), return_exceptions=True
    )
    assert results[0] == 10 and results[2] == 20
    assert isinstance(results[1], ValueError) and "job -1" in str(results[1])
    batcher.close(lambda: Unavailable("closed"))


async def test_a_worker_that_fails_fails_its_batch_and_the_next_batch_runs(
    executor: ThreadPoolExecutor,
) -> None:
    calls = []

    def run(jobs: Sequence[int], is_gone: object) -> list[int]:
        calls.append(list(jobs))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return list(jobs)

    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    with pytest.raises(RuntimeError, match="out of memory"):
        await batcher.submit(1)
    assert await batcher.submit(2) == 2
    batcher.close(lambda: Unavailable("closed"))


async def test_a_caller_that_gives_up_before_its_batch_is_left_out(executor: ThreadPoolExecutor) -> None:
    run = Recorder(delay_s=0.1)
    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0.03)
    gone = asyncio.ensure_future(batcher.submit(1))
    kept = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    gone.cancel()
    assert await first == 0 and await kept == 20
    assert run.batches == [[0], [2]]
    batcher.close(lambda: Unavailable("closed"))


async def test_a_caller_that_gives_up_while_its_batch_runs_is_gone_for_the_worker(
    executor: ThreadPoolExecutor,
) -> None:
    started, proceed = threading.Event(), threading.Event()
    seen: list[list[bool]] = []

    def run(jobs: Sequence[int], is_gone: Callable[[int], bool]) -> list[int]:
        started.set()
        proceed.wait(5)
        seen.append([is_gone(i) for i in range(len(jobs))])
        return [j * 10 for j in jobs]

    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.05)
    calls = [asyncio.ensure_future(batcher.submit(i)) for i in range(3)]
    assert await asyncio.to_thread(started.wait, 5)
    calls[1].cancel()
    await asyncio.sleep(0.01)  # the cancelled future's done callback runs on the loop
    proceed.set()
    assert await calls[0] == 0 and await calls[2] == 20
    assert seen == [[False, True, False]]
    batcher.close(lambda: Unavailable("closed"))


async def test_close_ends_the_running_batch_and_the_queue_with_its_error_and_refuses_later_calls(
    executor: ThreadPoolExecutor,
) -> None:
    started, proceed = threading.Event(), threading.Event()
    seen: list[bool] = []

    def run(jobs: Sequence[int], is_gone: Callable[[int], bool]) -> list[int]:
        started.set()
        proceed.wait(5)
        seen.append(is_gone(0))
        return list(jobs)

    batcher = Batcher(executor, run, max_batch_size=1, max_wait_s=lambda job: 0.0)
    running = asyncio.ensure_future(batcher.submit(0))
    queued = asyncio.ensure_future(batcher.submit(1))
    assert await asyncio.to_thread(started.wait, 5)  # the first is on the worker, the second waits
    assert batcher.close(lambda: Unavailable("shutting down")) == 2
    results = await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 1)
    assert [type(r) for r in results] == [Unavailable, Unavailable]
    assert results[0] is not results[1]  # one exception each: a raised one collects its caller's frames
    with pytest.raises(Unavailable, match="shutting down"):
        await batcher.submit(2)
    proceed.set()
    await asyncio.to_thread(executor.shutdown)
    assert seen == [True]  # the worker, still running, sees its caller gone


async def test_a_run_that_miscounts_fails_its_batch_and_the_next_call_is_served(
    executor: ThreadPoolExecutor,
) -> None:
    calls = []

    def run(jobs: Sequence[int], is_gone: object) -> list[int]:
        calls.append(list(jobs))
        return [] if len(calls) == 1 else list(jobs)

    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    with pytest.raises(RuntimeError, match="gave 0 outcomes"):
        await asyncio.wait_for(batcher.submit(1), 1)
    assert await asyncio.wait_for(batcher.submit(2), 1) == 2
    batcher.close(lambda: Unavailable("closed"))


async def test_a_serving_task_that_died_is_started_again(executor: ThreadPoolExecutor) -> None:
    batcher = Batcher(executor, Recorder(), max_batch_size=8, max_wait_s=lambda job: 0.0)
    assert await batcher.submit(1) == 10
    assert batcher._task is not None
    batcher._task.cancel()  # as if it had died
    await asyncio.sleep(0)
    assert await asyncio.wait_for(batcher.submit(2), 1) == 20
    batcher.close(lambda: Unavailable("closed"))


async def test_a_job_worth_no_wait_runs_at_once_and_one_worth_waiting_gathers_company(
    executor: ThreadPoolExecutor,
) -> None:
    """The servicer's rule: text (here even jobs) never waits; an image (odd) waits for others. The
    image's bound is an hour, so a text call that waited for company would never be answered."""
    run = Recorder()
    hour = 3600.0
    batcher = Batcher(executor, run, max_batch_size=2, max_wait_s=lambda job: 0.0 if job % 2 == 0 else hour)
    assert await batcher.submit(2) == 20  # alone, at once
    lone_image = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0)  # the image is gathering company
    assert await asyncio.gather(lone_image, batcher.submit(3)) == [10, 30]  # the batch is full: it runs
    assert run.batches == [[2], [1, 3]]
    batcher.close(lambda: Unavailable("closed"))


async def test_cheap_calls_go_before_expensive_ones_queued_earlier(executor: ThreadPoolExecutor) -> None:
    # Each job costs itself in seconds: four of 1 s queue behind a running one, then a free one arrives.
    # It runs next, not after the four, and no batch adds up to more than max_batch_cost (1.5 s: the free
    # one and one more).
    run = Recorder(delay_s=0.05)
    batcher = Batcher(
        executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0, cost=float, max_batch_cost=1.5
    )
    expensive = [asyncio.ensure_future(batcher.submit(1)) for _ in range(5)]
    await asyncio.sleep(0.01)  # the first batch (one job: two would cost 2 s) is running
    assert await batcher.submit(0) == 0
    await asyncio.gather(*expensive)
    assert run.batches == [[1], [0, 1], [1], [1], [1]]
    batcher.close(lambda: Unavailable("closed"))


async def test_an_expensive_call_is_not_starved_by_cheaper_ones_arriving_long_after_it(
    executor: ThreadPoolExecutor,
) -> None:
    # A job costing 2 ms goes ahead of free ones arriving over LINE_FACTOR x 2 ms = 20 ms after it.
    run = Recorder(delay_s=0.05)
    batcher = Batcher(executor, run, max_batch_size=1, max_wait_s=lambda job: 0.0, cost=lambda j: j / 1000)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0.01)  # running
    costly = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0.03)
    assert await asyncio.gather(first, costly, batcher.submit(0)) == [0, 20, 0]
    assert run.batches == [[0], [2], [0]]
    batcher.close(lambda: Unavailable("closed"))


async def test_a_call_is_weighed_once_as_it_arrives_not_again_for_every_batch(
    executor: ThreadPoolExecutor,
) -> None:
    # Five calls, one to a batch: weighing the queue for each batch weighed them 5 + 4 + 3 + 2 + 1 times
    # (with 10,000 image calls queued, 0.23 s of the event loop a batch).
    weighed: list[int] = []
    run = Recorder()

    def cost(job: int) -> float:
        weighed.append(job)
        return job / 1000

    batcher = Batcher(executor, run, max_batch_size=1, max_wait_s=lambda job: 0.0, cost=cost)
    assert await asyncio.gather(*(batcher.submit(i) for i in (4, 3, 2, 1, 0))) == [40, 30, 20, 10, 0]
    assert sorted(weighed) == [0, 1, 2, 3, 4]
    assert run.batches == [[0], [1], [2], [3], [4]]  # cheapest first
    batcher.close(lambda: Unavailable("closed"))
