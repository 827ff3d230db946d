"""Concurrent calls gathered into batches: a bounded wait for company, a bounded batch size, each
call's outcome its own, and a caller that gives up left out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.encoder.batcher import Batcher


class Recorder:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.delay_s = delay_s

    def __call__(self, jobs: Sequence[int]) -> list[int | BaseException]:
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
    batcher.close()


async def test_a_batch_never_exceeds_its_size_and_keeps_arrival_order(executor: ThreadPoolExecutor) -> None:
    run = Recorder()
    batcher = Batcher(executor, run, max_batch_size=3, max_wait_s=lambda job: 0.05)
    assert await asyncio.gather(*(batcher.submit(i) for i in range(7))) == [i * 10 for i in range(7)]
    assert run.batches == [[0, 1, 2], [3, 4, 5], [6]]
    batcher.close()


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
    batcher.close()


async def test_calls_that_arrive_during_a_batch_form_the_next_one(executor: ThreadPoolExecutor) -> None:
    run = Recorder(delay_s=0.1)
    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0.03)  # the first batch is running
    rest = await asyncio.gather(*(batcher.submit(i) for i in range(1, 4)))
    assert await first == 0 and rest == [10, 20, 30]
    assert run.batches == [[0], [1, 2, 3]]
    batcher.close()


async def test_one_calls_failure_is_its_own(executor: ThreadPoolExecutor) -> None:
    batcher = Batcher(executor, Recorder(), max_batch_size=8, max_wait_s=lambda job: 0.02)
    results = await asyncio.gather(
        batcher.submit(1), batcher.submit(-1), batcher.submit(2), return_exceptions=True
    )
    assert results[0] == 10 and results[2] == 20
    assert isinstance(results[1], ValueError) and "job -1" in str(results[1])
    batcher.close()


async def test_a_worker_that_fails_fails_its_batch_and_the_next_batch_runs(
    executor: ThreadPoolExecutor,
) -> None:
    calls = []

    def run(jobs: Sequence[int]) -> list[int]:
        calls.append(list(jobs))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return list(jobs)

    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    with pytest.raises(RuntimeError, match="out of memory"):
        await batcher.submit(1)
    assert await batcher.submit(2) == 2
    batcher.close()


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
    batcher.close()


async def test_close_cancels_the_running_batch_as_well_as_the_queue(executor: ThreadPoolExecutor) -> None:
    batcher = Batcher(executor, Recorder(delay_s=0.2), max_batch_size=1, max_wait_s=lambda job: 0.0)
    running = asyncio.ensure_future(batcher.submit(0))
    queued = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.05)  # the first is on the worker, the second waits
    batcher.close()
    results = await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 1)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)


async def test_a_run_that_miscounts_fails_its_batch_and_the_next_call_is_served(
    executor: ThreadPoolExecutor,
) -> None:
    calls = []

    def run(jobs: Sequence[int]) -> list[int]:
        calls.append(list(jobs))
        return [] if len(calls) == 1 else list(jobs)

    batcher = Batcher(executor, run, max_batch_size=8, max_wait_s=lambda job: 0.0)
    with pytest.raises(RuntimeError, match="gave 0 outcomes"):
        await asyncio.wait_for(batcher.submit(1), 1)
    assert await asyncio.wait_for(batcher.submit(2), 1) == 2
    batcher.close()


async def test_a_serving_task_that_died_is_started_again(executor: ThreadPoolExecutor) -> None:
    batcher = Batcher(executor, Recorder(), max_batch_size=8, max_wait_s=lambda job: 0.0)
    assert await batcher.submit(1) == 10
    assert batcher._task is not None
    batcher._task.cancel()  # as if it had died
    await asyncio.sleep(0)
    assert await asyncio.wait_for(batcher.submit(2), 1) == 20
    batcher.close()


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
    batcher.close()
