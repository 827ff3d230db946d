"""Scheduler: requests the engine says are not runnable this step (a grammar's matcher being rebuilt,
step/grammar_rebuilds.py) sit it out wherever they are, and a request whose samples were dropped runs
the same positions again; either way its outputs are the ones it gets otherwise."""

from __future__ import annotations

from services.decoder.tests.engine.scheduling_helpers import (
    FakeRunner,
    check_invariants,
    make_request,
    reference_outputs,
    run_until_done,
)
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler import Scheduler
from tandem.decoder.engine.scheduling.scheduler_config import SchedulerConfig


def _scheduler() -> tuple[Scheduler, FakeRunner]:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    scheduler = Scheduler(config, BlockManager(64, 4, enable_prefix_caching=True))
    return scheduler, FakeRunner(scheduler)


def _ids(plan) -> list[str]:  # noqa: ANN001
    return [item.request_id for item in plan.scheduled]


def test_a_running_request_not_runnable_sits_out_holding_its_blocks_while_its_neighbour_decodes() -> None:
    scheduler, runner = _scheduler()
    for name in "ab":
        scheduler.add_request(make_request(name, [1, 2, 3, 4, 5], max_new_tokens=6))
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))
    a = scheduler.get_request("a")
    assert a is not None
    blocks, computed = list(a.block_ids), a.num_computed_tokens
    for _ in range(3):
        plan = scheduler.schedule(not_runnable={"a"})
        check_invariants(scheduler, plan)
        assert _ids(plan) == ["b"]
        scheduler.update(plan, runner.execute(plan))
    assert (a.block_ids, a.num_computed_tokens) == (blocks, computed)
    run_until_done(scheduler, runner)
    assert a.output_token_ids == reference_outputs("a", 6)


def test_a_waiting_request_not_runnable_is_not_admitted_and_the_next_in_line_is() -> None:
    scheduler, runner = _scheduler()
    for name in "ab":
        scheduler.add_request(make_request(name, [1, 2, 3]))
    plan = scheduler.schedule(not_runnable={"a"})
    assert _ids(plan) == ["b"]
    scheduler.update(plan, runner.execute(plan))
    assert _ids(scheduler.schedule()) == ["b", "a"]


def test_an_unsampled_request_runs_the_same_positions_again_and_gets_its_own_outputs() -> None:
    # Its samples were dropped (its matcher filled in the step): it stays where it was, in the same
    # chunks, its proposal dropped, so its outputs are the ones it gets without the drop.
    scheduler, runner = _scheduler()
    scheduler.add_request(make_request("a", list(range(1, 10)), max_new_tokens=5))
    plan = scheduler.schedule()
    runner.execute(plan)
    scheduler.update(plan, {}, unsampled={"a"})
    a = scheduler.get_request("a")
    assert a is not None and (a.num_computed_tokens, a.output_token_ids) == (0, [])
    again = scheduler.schedule()
    assert [(i.start, i.num_new_tokens) for i in again.scheduled] == [(0, 9)]
    scheduler.update(again, runner.execute(again))
    a.draft_token_ids = [7, 8]
    plan = scheduler.schedule()
    assert plan.scheduled[0].num_draft_tokens == 2
    runner.execute(plan)
    scheduler.update(plan, {}, unsampled={"a"})
    assert (a.num_computed_tokens, a.draft_token_ids, len(a.output_token_ids)) == (9, [], 1)
    run_until_done(scheduler, runner)
    assert a.output_token_ids == reference_outputs("a", 5)


def test_a_waiting_request_not_runnable_takes_no_slot_from_a_running_one() -> None:
    """The batch full and a caller's request waiting (preempted for a fair turn) while its matcher is
    rebuilt: a slot was yielded for it every step, the victim re-admitted at once in its place and
    its prompt computed again (225 preemptions in 225 steps of a held rebuild)."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler = Scheduler(config, BlockManager(64, 4, enable_prefix_caching=False))
    runner = FakeRunner(scheduler)
    requests = [
        make_request(name, [1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=40, caller=caller)
        for name, caller in (("a1", "a"), ("a2", "a"), ("b", "b"))
    ]
    for request in requests:
        scheduler.add_request(request)
    preemptions = 0
    for _ in range(20):
        plan = scheduler.schedule(not_runnable={"b"})
        check_invariants(scheduler, plan)
        preemptions += len(plan.preempted_ids)
        scheduler.update(plan, runner.execute(plan))
    assert preemptions == 0
    run_until_done(scheduler, runner)
    assert [r.output_token_ids for r in requests] == [reference_outputs(r.request_id, 40) for r in requests]


def test_a_heavy_callers_turns_in_a_narrowed_step_go_to_its_runnable_requests() -> None:
    """A heavy caller's request not runnable, which ran least recently, took the caller's one row of a
    narrowed step and sat out, so the caller's other requests got no token while it was rebuilt."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, shared_step_seqs=2)
    scheduler = Scheduler(config, BlockManager(64, 4, enable_prefix_caching=False))
    runner = FakeRunner(scheduler)
    for name, caller in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("l", "light")):
        scheduler.add_request(make_request(name, [1, 2, 3], max_new_tokens=30, caller=caller))
    plan = scheduler.schedule()  # all four admitted and prefilled; then a1's matcher fills
    scheduler.update(plan, runner.execute(plan))
    rows = {"a2": 0, "a3": 0}
    for _ in range(20):
        plan = scheduler.schedule(not_runnable={"a1"})
        check_invariants(scheduler, plan)
        for name in _ids(plan):
            rows[name] = rows.get(name, 0) + 1
        scheduler.update(plan, runner.execute(plan))
    assert rows["a2"] + rows["a3"] >= 10 and rows.get("a1", 0) == 0
