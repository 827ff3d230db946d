"""Scheduler: one rule (advance num_computed_tokens toward num_tokens within a token budget) and
what follows from it: FCFS admission, chunked prefill, mixed prefill + decode steps, preemption."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.decoder.tests.engine.scheduling_helpers import (
    FakeRunner,
    check_invariants,
    embedding,
    make_request,
    reference_outputs,
    run_step,
    run_until_done,
)
from tandem.client.errors import ErrorInfo, InvalidArgument
from tandem.decoder.engine.request import RequestStatus, TokenSegment
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler import FAIR_TURN_TOKENS, Scheduler
from tandem.decoder.engine.scheduling.scheduler_config import (
    QueueFullError,
    RequestTooLongError,
    SchedulerConfig,
)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    prefix_caching: bool = True,
    **config: int | bool | tuple[int, ...],
) -> tuple[Scheduler, FakeRunner]:
    defaults: dict[str, int | bool | tuple[int, ...]] = dict(max_num_seqs=8, max_num_batched_tokens=64)
    scheduler = Scheduler(
        SchedulerConfig(**(defaults | config)),  # type: ignore[arg-type]
        BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
    )
    return scheduler, FakeRunner(scheduler)


def ids(plan) -> list[str]:
    return [item.request_id for item in plan.scheduled]


def test_requests_are_admitted_in_arrival_order() -> None:
    scheduler, _ = make_scheduler()
    for name in "cab":
        scheduler.add_request(make_request(name, [1, 2, 3]))
    assert ids(scheduler.schedule()) == ["c", "a", "b"]


def test_admission_takes_the_first_request_of_the_caller_running_fewest() -> None:
    scheduler, _ = make_scheduler(max_num_seqs=3)
    for name in ("a1", "a2", "a3", "a4"):
        scheduler.add_request(make_request(name, [1, 2, 3], caller="a"))
    scheduler.add_request(make_request("b1", [1, 2, 3], caller="b"))
    # a1 first (nobody runs yet), then b1 (its caller runs none, a's one), then a2: FCFS within a caller.
    assert ids(scheduler.schedule()) == ["a1", "b1", "a2"]


def test_a_full_batch_yields_one_slot_per_step_to_a_caller_running_two_fewer() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2)
    requests = [make_request(name, [1, 2, 3], max_new_tokens=6, caller="a") for name in ("a1", "a2", "a3")]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler, runner)
    requests.append(make_request("b1", [1, 2, 3], max_new_tokens=6, caller="b"))
    scheduler.add_request(requests[-1])
    plan = run_step(scheduler, runner)
    assert plan.preempted_ids == ("a2",)  # a's latest-admitted request
    assert ids(plan) == ["a1", "b1"]
    assert scheduler.waiting[0].request_id == "a2"  # first in line of its caller, before a3
    # One each now: nothing goes back and forth, and a's requests follow in order.
    for _ in range(3):
        assert not run_step(scheduler, runner).preempted_ids
    run_until_done(scheduler, runner)
    for request in requests:  # a2 recomputed after its preemption: the same outputs
        assert request.output_token_ids == reference_outputs(request.request_id, 6)


def test_a_caller_running_one_fewer_waits_for_a_free_slot() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=3)
    for name, caller in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        scheduler.add_request(make_request(name, [1, 2, 3], max_new_tokens=6, caller=caller))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b2", [1, 2, 3], max_new_tokens=6, caller="b"))
    plan = run_step(scheduler, runner)
    assert not plan.preempted_ids and ids(plan) == ["a1", "b1", "a2"]


def test_with_more_callers_than_slots_the_slots_go_round_a_turn_each() -> None:
    scheduler, runner = make_scheduler(num_blocks=1024, max_num_seqs=2)
    n = 3 * FAIR_TURN_TOKENS
    requests = [make_request(c, [1, 2, 3], max_new_tokens=n, caller=c) for c in "abc"]
    for request in requests:
        scheduler.add_request(request)
    admitted: list[tuple[int, list[str]]] = []  # (step, who got a slot) whenever it changes
    step = 0
    while scheduler.has_unfinished:
        plan = run_step(scheduler, runner)
        if not admitted or sorted(ids(plan)) != admitted[-1][1]:
            admitted.append((step, sorted(ids(plan))))
        step += 1
    # c waits for a's turn; then a for b's (which ran as long); then b for c's; and so on.
    assert admitted[:4] == [
        (0, ["a", "b"]),
        (FAIR_TURN_TOKENS, ["b", "c"]),
        (FAIR_TURN_TOKENS + 1, ["a", "c"]),
        (2 * FAIR_TURN_TOKENS, ["a", "b"]),
    ]
    for request in requests:  # recomputed after each turn: the same outputs
        assert request.output_token_ids == reference_outputs(request.request_id, n)


def test_a_late_caller_gets_the_next_turn_before_callers_that_have_had_one() -> None:
    # Slots must not circle between the callers that had them and the first in the queue.
    scheduler, runner = make_scheduler(num_blocks=4096, max_num_seqs=2)
    n = 4 * FAIR_TURN_TOKENS
    for c in "abcd":
        scheduler.add_request(make_request(c, [1, 2, 3], max_new_tokens=n, caller=c))
    run_step(scheduler, runner)
    late = make_request("late", [4, 5, 6], max_new_tokens=4, caller="late")
    scheduler.add_request(late)
    step = 1
    while late.output_token_ids == []:
        run_step(scheduler, runner)
        step += 1
    # c takes a's turn, d b's; the next turn is the late caller's, before a's or b's second one.
    assert step == 2 * FAIR_TURN_TOKENS + 1
    run_until_done(scheduler, runner)
    assert late.output_token_ids == reference_outputs("late", 4)


def test_beside_a_caller_with_requests_queued_a_neighbours_request_runs_every_step_of_a_narrow_one() -> None:
    # A flood of one caller fills the batch and queues more; a neighbour with one request gets a slot
    # (yielded), then runs every step while the flood's requests take turns for the other two rows.
    scheduler, runner = make_scheduler(num_blocks=512, max_num_seqs=8, shared_step_seqs=3)
    flood = [make_request(f"f{i}", [1, 2, 3], max_new_tokens=30, caller="flood") for i in range(10)]
    for request in flood:
        scheduler.add_request(request)
    assert len(ids(run_step(scheduler, runner))) == 8  # nobody to protect: the whole batch
    neighbour = make_request("n", [4, 5, 6], max_new_tokens=12, caller="n")
    scheduler.add_request(neighbour)
    plan = run_step(scheduler, runner)  # a slot yielded, the neighbour admitted (its prefill)
    assert "n" in ids(plan) and len(plan.preempted_ids) == 1
    assert len(ids(plan)) == 4  # narrow already: 3 of the flood's and the newcomer, always let in
    last_ran = {r.request_id: 0 for r in scheduler.running if r.caller == "flood"}
    step = 0
    while not neighbour.is_finished:
        plan = run_step(scheduler, runner)
        step += 1
        assert "n" in ids(plan) and len(ids(plan)) == 3, ids(plan)
        for request_id in ids(plan):
            last_ran[request_id] = step
        # The flood's 7 running requests take the 2 other rows in turn: none waits more than 4 steps.
        assert all(step - ran <= 4 for request_id, ran in last_ran.items() if request_id != "n")
    # The neighbour gone, the flood has the whole batch again.
    assert len(ids(run_step(scheduler, runner))) == 8
    run_until_done(scheduler, runner)
    for request in [*flood, neighbour]:  # who sat out when changes no request's outputs
        expected = reference_outputs(request.request_id, request.stopping.max_new_tokens)
        assert request.output_token_ids == expected


def test_beside_more_neighbours_than_a_narrow_step_holds_a_backlogged_caller_still_runs_each_step() -> None:
    scheduler, runner = make_scheduler(num_blocks=512, max_num_seqs=8, shared_step_seqs=3)
    busy = [make_request(f"b{i}", [1, 2, 3], max_new_tokens=20, caller="busy") for i in range(6)]
    for request in busy:
        scheduler.add_request(request)
    run_step(scheduler, runner)  # 6 running, nothing waiting
    scheduler.add_request(make_request("b-late", [1, 2, 3], max_new_tokens=20, caller="busy"))
    for caller in "xyz":  # three neighbours take the two free slots and a yielded one
        scheduler.add_request(make_request(caller, [4, 5], max_new_tokens=20, caller=caller))
    for _ in range(2):
        run_step(scheduler, runner)
    for _ in range(10):
        plan = run_step(scheduler, runner)
        running = [r.caller for r in scheduler.running]
        neighbours = [i for i in ids(plan) if i in "xyz"]
        # Every neighbour's request runs, and one of the busy caller's: one row a step each.
        assert len(neighbours) == running.count("x") + running.count("y") + running.count("z")
        assert len(ids(plan)) - len(neighbours) == 1, ids(plan)
    run_until_done(scheduler, runner)
    assert all(r.output_token_ids == reference_outputs(r.request_id, 20) for r in busy)


def test_beside_a_caller_running_more_than_a_narrow_step_holds_a_neighbour_runs_in_narrow_steps() -> None:
    # Nothing queued anywhere (a connection's stream bound keeps the flood's queue empty), yet one
    # caller runs 10: heavy. A neighbour's steps hold it and 2 of the 10, in turns; a caller running
    # no more than the limit is light, and beside it the steps stay whole.
    scheduler, runner = make_scheduler(num_blocks=512, max_num_seqs=12, shared_step_seqs=3)
    flood = [make_request(f"f{i}", [1, 2, 3], max_new_tokens=30, caller="flood") for i in range(10)]
    for request in flood:
        scheduler.add_request(request)
    run_step(scheduler, runner)
    neighbour = make_request("n", [4, 5, 6], max_new_tokens=8, caller="n")
    scheduler.add_request(neighbour)
    assert len(ids(run_step(scheduler, runner))) == 4  # its admission: 3 of the flood's and it
    while not neighbour.is_finished:
        plan = run_step(scheduler, runner)
        assert "n" in ids(plan) and len(ids(plan)) == 3, ids(plan)
    assert len(ids(run_step(scheduler, runner))) == 10
    run_until_done(scheduler, runner)
    for request in [*flood, neighbour]:
        assert request.output_token_ids == reference_outputs(
            request.request_id, request.stopping.max_new_tokens
        )

    scheduler, runner = make_scheduler(num_blocks=512, max_num_seqs=12, shared_step_seqs=3)
    for i in range(3):
        scheduler.add_request(make_request(f"g{i}", [1, 2, 3], max_new_tokens=10, caller="light"))
    scheduler.add_request(make_request("m", [4, 5], max_new_tokens=10, caller="m"))
    for _ in range(5):
        assert len(ids(run_step(scheduler, runner))) == 4


def test_a_newcomer_that_cannot_be_admitted_yet_leaves_the_step_whole() -> None:
    # Eight callers each run one request and queue another (a full batch, nobody two ahead of the
    # newcomer, no turn used up yet): nothing is yielded, so the newcomer waits, and narrowing the
    # step for it would only slow everybody else.
    scheduler, runner = make_scheduler(num_blocks=512, max_num_seqs=8, shared_step_seqs=3)
    for caller in "abcdefgh":
        for i in range(2):
            scheduler.add_request(make_request(f"{caller}{i}", [1, 2, 3], max_new_tokens=10, caller=caller))
    assert len(ids(run_step(scheduler, runner))) == 8
    scheduler.add_request(make_request("new", [4, 5], max_new_tokens=10, caller="new"))
    plan = run_step(scheduler, runner)
    assert "new" not in ids(plan) and not plan.preempted_ids and len(ids(plan)) == 8


def test_steps_stay_whole_for_callers_with_nothing_queued_and_for_a_flood_alone() -> None:
    # Many callers with one request each (nothing waits) and one caller's backlog alone: nobody is
    # protected from anybody, so every running request runs every step.
    for callers in ("abcdefgh", "a" * 12):
        scheduler, runner = make_scheduler(num_blocks=512, max_num_seqs=8, shared_step_seqs=3)
        for i, caller in enumerate(callers):
            scheduler.add_request(make_request(f"r{i}", [1, 2, 3], max_new_tokens=10, caller=caller))
        for _ in range(5):
            assert len(ids(run_step(scheduler, runner))) == 8


def test_blocks_are_taken_back_from_the_busiest_caller_not_from_the_one_just_admitted() -> None:
    scheduler, runner = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4)
    requests = [
        make_request(name, [1, 2, 3], max_new_tokens=12, caller=name[0]) for name in ("a1", "a2", "a3")
    ]
    requests.append(make_request("b1", [4, 5, 6], max_new_tokens=12, caller="b"))
    for request in requests:
        scheduler.add_request(request)
    plans = run_until_done(scheduler, runner)
    victims = [victim for plan in plans for victim in plan.preempted_ids]
    assert victims and victims[0] == "a3"  # b1, admitted last, keeps its one slot
    assert "b1" not in victims[:2]
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.request_id, 12)


def test_first_step_prefills_the_prompt_and_samples_once() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], max_new_tokens=3))

    plan = run_step(scheduler, runner)
    (item,) = plan.scheduled
    assert (item.start, item.num_new_tokens, item.is_prefill, item.needs_logits) == (0, 5, True, True)

    plan = run_step(scheduler, runner)
    (item,) = plan.scheduled
    assert (item.start, item.num_new_tokens, item.is_prefill, item.needs_logits) == (5, 1, False, True)
    assert scheduler.get_request("a").output_token_ids == reference_outputs("a", 2)


def test_head_of_queue_is_not_overtaken_when_blocks_run_out() -> None:
    scheduler, _ = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
    scheduler.add_request(make_request("a", list(range(12)), max_new_tokens=1))  # 3 blocks
    scheduler.add_request(make_request("b", list(range(50, 58)), max_new_tokens=1))  # 2 blocks
    scheduler.add_request(make_request("c", [7], max_new_tokens=1))  # would fit, but comes after b

    assert ids(scheduler.schedule()) == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_step_never_exceeds_token_budget() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=10)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", list(range(i * 10, i * 10 + 7)), max_new_tokens=5))
    plans = run_until_done(scheduler, runner)
    assert all(plan.num_batched_tokens <= 10 for plan in plans)
    assert plans[0].num_batched_tokens == 10  # r0 whole, then 3 tokens of r1's prompt
    assert [item.num_new_tokens for item in plans[0].scheduled] == [7, 3]


def test_long_prompt_is_chunked_to_the_budget() -> None:
    scheduler, runner = make_scheduler(num_blocks=400, block_size=16, max_num_batched_tokens=256)
    scheduler.add_request(make_request("long", [i % 50 for i in range(3000)], max_new_tokens=2))

    plans = [run_step(scheduler, runner) for _ in range(math.ceil(3000 / 256))]

    assert [p.num_batched_tokens for p in plans] == [256] * 11 + [3000 - 11 * 256]
    assert [p.scheduled[0].needs_logits for p in plans] == [False] * 11 + [True]
    assert all(p.scheduled[0].is_prefill for p in plans)
    assert scheduler.get_request("long").num_output_tokens == 1


def test_running_request_keeps_decoding_while_a_long_prompt_is_chunked() -> None:
    scheduler, runner = make_scheduler(num_blocks=400, block_size=16, max_num_batched_tokens=256)
    scheduler.add_request(make_request("chat", [1, 2, 3], max_new_tokens=40))
    run_step(scheduler, runner)  # chat's prefill
    scheduler.add_request(make_request("long", [i % 50 for i in range(3000)], max_new_tokens=2))

    plans = []
    while scheduler.get_request("long").num_output_tokens == 0:
        plans.append(run_step(scheduler, runner))

    assert len(plans) == math.ceil(3000 / 256)
    for plan in plans:  # every step is mixed: one decode token first, then a prefill chunk
        decode, prefill = plan.scheduled
        assert (decode.request_id, decode.num_new_tokens, decode.is_prefill) == ("chat", 1, False)
        assert decode.needs_logits
        assert (prefill.request_id, prefill.is_prefill) == ("long", True)
    assert sum(plan.scheduled[1].num_new_tokens for plan in plans) == 3000
    assert scheduler.get_request("chat").output_token_ids == reference_outputs("chat", 1 + len(plans))


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, [1, 2], max_new_tokens=3))
    plans = run_until_done(scheduler, runner)
    assert all(len(plan.scheduled) <= 2 for plan in plans)
    assert ids(plans[0]) == ["a", "b"]
    assert "c" in ids(plans[3])  # admitted the step after a and b finished


def test_add_request_raises_queue_full_at_max_waiting() -> None:
    scheduler, _ = make_scheduler(max_waiting=2)
    scheduler.add_request(make_request("a", [1]))
    scheduler.add_request(make_request("b", [1]))
    with pytest.raises(QueueFullError, match=r"waiting queue is full \(2 requests, --max-queue\)") as caught:
        scheduler.add_request(make_request("c", [1]))
    assert caught.value.info == ErrorInfo("QUEUE_FULL", "tandem.decoder", {"maxWaitingRequests": "2"})
    scheduler.schedule()  # a and b start running: the queue has room again
    scheduler.add_request(make_request("c", [1]))


def test_requests_paused_for_their_readers_never_refuse_a_new_request() -> None:
    """A paused request holds no slot and no KV block, and nothing but its client ends it: counted in
    max_waiting, one connection's unread streams would refuse every caller while the engine idles."""
    scheduler, _ = make_scheduler(max_num_seqs=4, max_waiting=4)
    for attempt in range(3):  # unread streams admitted, run, then paused as their readers fall behind
        for index in range(4):
            scheduler.add_request(make_request(f"unread-{attempt}-{index}", [1, 2, 3]))
        scheduler.schedule()
        for request in list(scheduler.running):
            scheduler.pause(request.request_id)
    assert (scheduler.num_paused, scheduler.num_running, scheduler.num_waiting) == (12, 0, 0)
    scheduler.add_request(make_request("neighbour", [5, 6]))
    assert ids(scheduler.schedule()) == ["neighbour"]


def test_request_needing_more_blocks_than_the_cache_is_rejected() -> None:
    scheduler, _ = make_scheduler(num_blocks=4, block_size=4)  # 3 usable blocks: 12 positions
    with pytest.raises(RequestTooLongError, match="KV blocks") as info:
        scheduler.add_request(make_request("a", list(range(10)), max_new_tokens=4))
    assert (info.value.field, info.value.limit, info.value.value) == ("stopping.max_new_tokens", 3, 4)
    assert info.value.info == ErrorInfo(
        "KV_CAPACITY", "tandem.decoder", {"neededBlocks": "4", "maxBlocks": "3"}
    )
    scheduler.add_request(make_request("b", list(range(10)), max_new_tokens=3))  # 12 positions of KV


def test_duplicate_request_id_is_rejected() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", [1]))
    with pytest.raises(InvalidArgument) as info:
        scheduler.add_request(make_request("a", [2]))
    assert info.value.field == "request_id"


def test_prefix_cache_hit_on_admission_skips_the_cached_tokens() -> None:
    scheduler, runner = make_scheduler(block_size=4)
    scheduler.add_request(make_request("first", list(range(10)), max_new_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("second", list(range(10)) + [7, 7], max_new_tokens=1))

    (item,) = scheduler.schedule().scheduled
    request = scheduler.get_request("second")
    assert request.num_cached_tokens == 8
    assert (item.start, item.num_new_tokens) == (8, 4)


def test_lowest_priority_request_is_preempted_and_resumes_with_its_outputs() -> None:
    # 6 usable blocks of 4; each request needs 2 blocks for its prompt and 4 by its end.
    scheduler, runner = make_scheduler(num_blocks=7, block_size=4, prefix_caching=False)
    scheduler.add_request(make_request("a", list(range(8)), max_new_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("b", list(range(20, 28)), max_new_tokens=8, arrival_time=2.0))

    plans = []
    while not any(plan.preempted_ids for plan in plans):
        plans.append(run_step(scheduler, runner))
    b = scheduler.get_request("b")
    assert plans[-1].preempted_ids == ("b",)
    assert ids(plans[-1]) == ["a"]
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.block_ids, b.num_preemptions) == (0, [], 1)
    assert list(scheduler.waiting) == [b]
    num_outputs_before = b.num_output_tokens
    assert num_outputs_before > 0

    resumed = None
    while scheduler.has_unfinished:
        plan = run_step(scheduler, runner)
        resumed = resumed or next((item for item in plan.scheduled if item.request_id == "b"), None)
    # On resume, prompt and outputs are recomputed as one prefill, then decoding continues.
    assert (resumed.start, resumed.num_new_tokens) == (0, 8 + num_outputs_before)
    assert resumed.needs_logits
    assert b.output_token_ids == reference_outputs("b", 8)
    assert scheduler.block_manager.num_free_blocks == 6


def test_preemption_takes_the_latest_arrival_not_the_next_in_line() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)  # 3 blocks
    scheduler.add_request(make_request("a", [1, 2, 3, 4], max_new_tokens=3, arrival_time=1.0))
    scheduler.add_request(make_request("b", [5, 6], max_new_tokens=3, arrival_time=2.0))
    scheduler.add_request(make_request("c", [7, 8], max_new_tokens=3, arrival_time=3.0))
    run_step(scheduler, runner)  # one block each; a's next token needs a second block

    plan = run_step(scheduler, runner)
    assert plan.preempted_ids == ("c",)
    assert ids(plan) == ["a", "b"]
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == 3


def test_failing_request_preempts_itself_when_it_is_the_lowest_priority() -> None:
    scheduler, runner = make_scheduler(num_blocks=5, block_size=4, prefix_caching=False)  # 4 blocks
    scheduler.add_request(make_request("a", list(range(6)), max_new_tokens=2, arrival_time=1.0))
    scheduler.add_request(make_request("b", list(range(10, 18)), max_new_tokens=4, arrival_time=2.0))
    run_step(scheduler, runner)  # both prefilled: all 4 blocks held
    assert scheduler.block_manager.num_free_blocks == 0

    plan = run_step(scheduler, runner)  # a fits in its block; b needs a third block
    assert plan.preempted_ids == ("b",)
    assert ids(plan) == ["a"]
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == 4


def test_no_new_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler, runner = make_scheduler(num_blocks=5, block_size=4, prefix_caching=False)
    scheduler.add_request(make_request("a", list(range(6)), max_new_tokens=2, arrival_time=1.0))
    scheduler.add_request(make_request("b", list(range(10, 18)), max_new_tokens=4, arrival_time=2.0))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("c", [1], max_new_tokens=1, arrival_time=3.0))
    plan = run_step(scheduler, runner)
    assert plan.preempted_ids == ("b",)
    assert "c" not in ids(plan)
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_abort_frees_blocks_and_is_idempotent(when: str) -> None:
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", list(range(9)), max_new_tokens=5))
    scheduler.add_request(make_request("second", list(range(9)), max_new_tokens=5))
    run_step(scheduler, runner)
    victim = "second" if when == "waiting" else "first"
    request = scheduler.get_request(victim)

    assert scheduler.abort(victim)
    assert not scheduler.abort(victim)
    assert not scheduler.abort("never-seen")
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert request.block_ids == []
    assert scheduler.get_request(victim) is None
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 0) if when == "waiting" else (0, 1)
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def test_abort_between_schedule_and_update_is_skipped_by_update() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    plan = scheduler.schedule()
    sampled = runner.execute(plan)
    scheduler.abort("a")
    scheduler.update(plan, sampled)
    assert plan.scheduled[0].request.output_token_ids == []
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def test_finish_requires_a_finished_status() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="FINISHED"):
        scheduler.finish("a", RequestStatus.RUNNING)


def test_free_block_count_returns_to_initial_after_every_request_finishes() -> None:
    scheduler, runner = make_scheduler(num_blocks=12, block_size=4)
    initial = scheduler.block_manager.num_free_blocks
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", list(range(i, i + 9)), max_new_tokens=6))
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == initial
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.has_unfinished) == (0, 0, False)


def test_embedding_prompts_share_batches_and_cache_with_token_prompts() -> None:
    scheduler, runner = make_scheduler(block_size=4)
    rows = ["u", "v", "w", "x", "y"]
    scheduler.add_request(make_request("e1", [embedding(rows), TokenSegment([1, 2, 3, 4])]))
    scheduler.add_request(make_request("t", [1, 2, 3, 4, 5]))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("e2", [embedding(rows), TokenSegment([1, 2, 3, 4])]))
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.num_prefix_hits_tokens == 8  # e2 reuses e1's two full blocks
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


# A random workload's shape: the pool, the step budget, the batch, prefix caching, and the seed of
# everything else it draws (requests, their lengths, aborts).
WORKLOADS = dict(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.integers(1, 8),
    num_blocks=st.integers(3, 40),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    shared_step_seqs=st.one_of(st.none(), st.integers(1, 4)),
    long_prefill_token_threshold=st.one_of(st.none(), st.integers(1, 8)),
)


@settings(max_examples=200, deadline=None)
@given(**WORKLOADS)
def test_random_workloads_keep_invariants_and_every_request_finishes(
    seed: int,
    block_size: int,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    prefix_caching: bool,
    shared_step_seqs: int | None,
    long_prefill_token_threshold: int | None,
) -> None:
    rng = random.Random(seed)
    scheduler, runner = make_scheduler(
        num_blocks,
        block_size,
        prefix_caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_waiting=8,
        shared_step_seqs=shared_step_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    accepted, aborted = [], set()
    num_to_add = rng.randint(1, 16)
    step = 0
    while num_to_add or scheduler.has_unfinished:
        if num_to_add and rng.random() < 0.5:
            num_to_add -= 1
            accepted.extend(_add_random_request(scheduler, rng, f"r{num_to_add}", float(step)))
        if scheduler.has_unfinished and rng.random() < 0.05:
            victim = rng.choice([r.request_id for r in accepted if not r.is_finished])
            assert scheduler.abort(victim)
            aborted.add(victim)
        run_step(scheduler, runner)
        step += 1
        assert step < 5000, "the scheduler stopped making progress"

    for request in accepted:
        assert request.is_finished
        if request.request_id not in aborted:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.output_token_ids == reference_outputs(
                request.request_id, request.stopping.max_new_tokens
            )
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def _add_random_request(scheduler: Scheduler, rng: random.Random, request_id: str, arrival: float) -> list:
    # Few distinct prefixes and embedding rows, so the prefix cache is hit and shared.
    segments = [TokenSegment([rng.choice([1, 2])] * rng.randint(0, 12))]
    if rng.random() < 0.3:
        segments.append(embedding([rng.choice("ab") for _ in range(rng.randint(1, 6))]))
    segments.append(TokenSegment([rng.randint(0, 9) for _ in range(rng.randint(1, 4))]))
    request = make_request(
        request_id,
        segments,
        max_new_tokens=rng.randint(1, 10),
        arrival_time=arrival,
        caller=rng.choice("xyz"),
    )
    try:
        scheduler.add_request(request)
    except (QueueFullError, RequestTooLongError):
        return []
    return [request]


def test_check_invariants_holds_on_an_idle_scheduler() -> None:
    scheduler, _ = make_scheduler()
    check_invariants(scheduler, scheduler.schedule())


def test_a_paused_request_leaves_the_batch_holds_no_blocks_and_resumes_with_the_same_outputs() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("unread", list(range(10)), max_new_tokens=8))
    scheduler.add_request(make_request("other", [1, 2, 3], max_new_tokens=8))
    for _ in range(3):
        run_step(scheduler, runner)
    unread = scheduler.get_request("unread")
    assert unread is not None
    outputs = list(unread.output_token_ids)
    assert scheduler.pause("unread") and not scheduler.pause("unread")
    assert unread.status is RequestStatus.PAUSED and not unread.block_ids
    assert scheduler.has_unfinished and (scheduler.num_running, scheduler.num_paused) == (1, 1)
    for _ in range(3):
        assert "unread" not in ids(run_step(scheduler, runner))
    assert unread.output_token_ids == outputs
    assert scheduler.resume("unread") and not scheduler.resume("unread")
    run_until_done(scheduler, runner)
    assert unread.output_token_ids == reference_outputs("unread", 8)  # recomputed, never resampled


def test_a_scheduler_holding_only_paused_requests_has_nothing_to_schedule() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_new_tokens=4))
    run_step(scheduler, runner)
    scheduler.pause("a")
    assert scheduler.has_unfinished and not scheduler.has_schedulable
    assert scheduler.schedule().is_empty
    assert scheduler.abort("a")  # a paused request ends like any other
    assert not scheduler.has_unfinished and scheduler.num_paused == 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def test_with_a_per_request_cap_a_prefill_is_chunked_the_same_alone_and_among_neighbours() -> None:
    # The batch-invariant mode's scheduling: each request's chunks are its own, never cut short by
    # what its neighbours took of the step's budget.
    def chunks(neighbours: int) -> list[tuple[int, int]]:
        scheduler, runner = make_scheduler(
            num_blocks=256, max_num_seqs=8, max_num_batched_tokens=8 * 6, max_tokens_per_request=6
        )
        for i in range(neighbours):
            scheduler.add_request(make_request(f"n{i}", list(range(5 + i)), max_new_tokens=3))
        scheduler.add_request(make_request("long", list(range(40, 57)), max_new_tokens=2))
        seen = []
        for plan in run_until_done(scheduler, runner):
            seen += [(item.start, item.end) for item in plan.scheduled if item.request_id == "long"]
        return seen

    alone = chunks(0)
    assert alone == [(0, 6), (6, 12), (12, 17), (17, 18)]
    assert chunks(3) == chunks(7) == alone


# -- speculation: proposed tokens verified in a decode step -------------------------------------


def _decoding(scheduler, runner, request_id: str = "a", prompt_len: int = 5, max_new_tokens: int = 12):
    """A request past its prefill: its next step is a decode."""
    request = make_request(request_id, list(range(1, prompt_len + 1)), max_new_tokens=max_new_tokens)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    assert request.num_computed_tokens == request.num_tokens - 1
    return request


def test_a_proposal_runs_after_the_last_token_and_only_its_right_prefix_is_kept() -> None:
    scheduler, runner = make_scheduler()
    request = _decoding(scheduler, runner)
    truth = reference_outputs("a", 12)
    start = request.num_computed_tokens
    # The first two guesses are right, the third wrong: 2 accepted, then the sample at the miss.
    plan = run_step(scheduler, runner, propose=lambda r: [truth[1], truth[2], truth[3] + 1, truth[4]])
    (item,) = plan.scheduled
    assert (item.start, item.num_new_tokens, item.num_draft_tokens) == (start, 5, 4)
    assert request.output_token_ids == truth[:4]
    # Computed: the last token and the two accepted guesses; the rest of the step's slots are stale.
    assert request.num_computed_tokens == start + 3 == request.num_tokens - 1
    assert request.draft_token_ids == []
    run_until_done(scheduler, runner)
    assert request.output_token_ids == truth


def test_a_wholly_right_proposal_gives_every_token_and_the_next() -> None:
    scheduler, runner = make_scheduler()
    request = _decoding(scheduler, runner)
    truth = reference_outputs("a", 12)
    run_step(scheduler, runner, propose=lambda r: truth[1:4])
    assert request.output_token_ids == truth[:5]


def test_proposals_take_only_what_the_step_has_left_after_admissions() -> None:
    # Budget 8: the decode takes 1 and the newcomer's prompt 6, so one proposed token fits.
    scheduler, runner = make_scheduler(max_num_batched_tokens=8)
    request = _decoding(scheduler, runner)
    scheduler.add_request(make_request("b", [7] * 6))
    plan = run_step(scheduler, runner, propose=lambda r: [1, 2, 3, 4])
    assert ids(plan) == ["a", "b"]
    assert plan.scheduled[0].num_draft_tokens == 1
    assert plan.num_batched_tokens == 8
    assert request.num_output_tokens in (2, 3)


def test_proposals_never_take_more_attention_rows_than_max_num_rows() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2, max_num_rows=3)
    _decoding(scheduler, runner, "a")
    _decoding(scheduler, runner, "b")
    plan = run_step(scheduler, runner, propose=lambda r: [1, 2, 3])
    assert [item.num_draft_tokens for item in plan.scheduled] == [1, 0]


def test_a_proposal_without_free_blocks_is_dropped_rather_than_preempting() -> None:
    # 4 usable blocks of 4 positions: a holds 1 (positions 0-3), b the other 3.
    scheduler, runner = make_scheduler(num_blocks=5, block_size=4)
    request = _decoding(scheduler, runner, prompt_len=2, max_new_tokens=12)
    scheduler.add_request(make_request("b", [9] * 11, max_new_tokens=2))
    run_step(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == 0
    # a decodes position 3, in its block; its guesses would need a new one: they go, nobody is preempted.
    plan = run_step(scheduler, runner, propose=lambda r: [1, 2, 3])
    assert plan.preempted_ids == ()
    assert [(item.request_id, item.num_draft_tokens) for item in plan.scheduled] == [("a", 0), ("b", 0)]
    run_until_done(scheduler, runner)
    assert request.output_token_ids == reference_outputs("a", 12)


def test_a_prefill_chunk_never_verifies_a_proposal() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", list(range(1, 11)))
    scheduler.add_request(request)
    request.draft_token_ids = [1, 2]
    plan = scheduler.schedule()
    assert plan.scheduled[0].num_draft_tokens == 0
    assert request.draft_token_ids == []


@settings(max_examples=150, deadline=None)
@given(**WORKLOADS, extra_rows=st.one_of(st.none(), st.integers(0, 6)))
def test_random_workloads_with_proposals_give_the_same_outputs_as_without(
    seed: int,
    block_size: int,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    extra_rows: int | None,
    prefix_caching: bool,
    shared_step_seqs: int | None,
    long_prefill_token_threshold: int | None,
) -> None:
    """Guesses right, half right and wrong, under preemption, chunking and prefix caching: every
    request ends with exactly its reference outputs, and every block comes back."""
    rng = random.Random(seed)
    max_num_rows = None if extra_rows is None else max_num_seqs + extra_rows
    scheduler, runner = make_scheduler(
        num_blocks,
        block_size,
        prefix_caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_num_rows=max_num_rows,
        shared_step_seqs=shared_step_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )

    def propose(request) -> list[int]:
        n, room = request.num_output_tokens, request.stopping.max_new_tokens - request.num_output_tokens
        guess = reference_outputs(request.request_id, n + room)[n : n + min(rng.randint(0, 5), room - 1)]
        if guess and rng.random() < 0.4:
            guess[rng.randrange(len(guess))] += 1  # a wrong token somewhere
        return guess

    accepted = []
    for i in range(rng.randint(1, 12)):
        accepted.extend(_add_random_request(scheduler, rng, f"r{i}", float(i)))
    run_until_done(scheduler, runner, max_steps=5000, propose=propose)
    for request in accepted:
        expected = reference_outputs(request.request_id, request.stopping.max_new_tokens)
        assert request.output_token_ids == expected
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


# -- long prefills beside decodes: long_prefill_token_threshold ---------------------------------


def _chunks(plan) -> list[tuple[str, int]]:
    return [(item.request_id, item.num_new_tokens) for item in plan.scheduled]


def test_while_a_decode_shares_the_step_a_prefill_chunk_takes_the_threshold_less_the_decode_row() -> None:
    scheduler, runner = make_scheduler(long_prefill_token_threshold=8)
    _decoding(scheduler, runner, "a", max_new_tokens=20)
    scheduler.add_request(make_request("long", list(range(40)), max_new_tokens=2))
    assert _chunks(run_step(scheduler, runner)) == [("a", 1), ("long", 7)]
    assert _chunks(run_step(scheduler, runner)) == [("a", 1), ("long", 7)]


def test_a_prefill_with_no_decode_beside_it_takes_the_whole_budget() -> None:
    scheduler, runner = make_scheduler(long_prefill_token_threshold=8)
    scheduler.add_request(make_request("long", list(range(40))))
    scheduler.add_request(make_request("other", list(range(50, 70))))
    assert _chunks(run_step(scheduler, runner)) == [("long", 40), ("other", 20)]


def test_once_the_decode_beside_it_finishes_the_rest_of_the_prefill_runs_in_one_chunk() -> None:
    scheduler, runner = make_scheduler(long_prefill_token_threshold=8)
    _decoding(scheduler, runner, "a", max_new_tokens=2)
    scheduler.add_request(make_request("long", list(range(40))))
    assert _chunks(run_step(scheduler, runner)) == [("a", 1), ("long", 7)]  # a's last token
    assert _chunks(run_step(scheduler, runner)) == [("long", 33)]


@pytest.mark.parametrize(("threshold", "chunk"), [(8, 5), (4, 2), (2, 1)])
def test_each_decode_row_takes_a_position_of_the_threshold_down_to_half_of_it(
    threshold: int, chunk: int
) -> None:
    # So that a power-of-two threshold is a static-shape bucket, whatever the decodes beside it.
    scheduler, runner = make_scheduler(long_prefill_token_threshold=threshold)
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, [i, 1, 2], max_new_tokens=20))
    run_step(scheduler, runner)  # three prefills with no decode beside them: not capped
    scheduler.add_request(make_request("long", list(range(40))))
    assert _chunks(run_step(scheduler, runner)) == [("a", 1), ("b", 1), ("c", 1), ("long", chunk)]


def test_with_more_decodes_than_the_threshold_a_prefill_still_takes_half_of_it_a_step() -> None:
    # At one position a step, 520 decodes beside a 2,000-token prompt kept it 2,000 steps from its first
    # token (threshold 512); at half the threshold it takes 8 chunks.
    scheduler, runner = make_scheduler(num_blocks=256, long_prefill_token_threshold=8, max_num_seqs=32)
    for i in range(20):
        scheduler.add_request(make_request(f"d{i}", [i, 1], max_new_tokens=50))
    run_step(scheduler, runner)  # twenty prefills, no decode beside them
    scheduler.add_request(make_request("long", list(range(40))))
    chunks = [dict(_chunks(run_step(scheduler, runner)))["long"] for _ in range(10)]
    assert chunks == [4] * 10


@pytest.mark.parametrize(
    ("threshold", "num_decodes", "chunk"), [(32, 1, 16), (16, 1, 16), (16, 3, 16), (63, 2, 16), (2, 1, 4)]
)
def test_with_prefill_buckets_a_capped_chunk_takes_the_largest_bucket_within_the_threshold(
    threshold: int, num_decodes: int, chunk: int
) -> None:
    # Each chunk runs as a graph of its own padded up to a bucket (XLA), the decode rows in another:
    # 15 positions would pad up to 64 and cost what an uncapped chunk does. Below the smallest
    # bucket, the smallest.
    scheduler, runner = make_scheduler(long_prefill_token_threshold=threshold, prefill_buckets=(4, 16, 64))
    for i in range(num_decodes):
        scheduler.add_request(make_request(f"d{i}", [i, 1, 2], max_new_tokens=20))
    run_step(scheduler, runner)  # prefills with no decode beside them: not capped
    scheduler.add_request(make_request("long", list(range(60))))
    assert dict(_chunks(run_step(scheduler, runner)))["long"] == chunk
    assert dict(_chunks(run_step(scheduler, runner)))["long"] == chunk
