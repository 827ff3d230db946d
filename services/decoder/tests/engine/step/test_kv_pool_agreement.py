"""Every rank says whether its KV pool was allocated: a refusal on any rank is every rank's, the lowest
rank's first, with its blocks, bytes and the allocator's words; a group whose pools all fit agrees on
none; rank 0 whose set-up failed before its pool says so there, and every other rank stops."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.decoder.engine.step.kv_pool_agreement import (
    MAX_CAUSE_BYTES,
    SAY_FAILED_WAIT_S,
    first_refusal,
    say_failed,
)
from tandem.decoder.engine.step.rank_zero_failed import RankZeroFailed
from tandem.decoder.models.kv_pool import KvPoolUnallocated


class ThreadRanks:
    """A group of ranks as threads: all_gather_control stacks what every rank gave, as gloo's does."""

    def __init__(self, world_size: int) -> None:
        self.given: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=10)

    def rank(self, rank: int) -> _Rank:
        return _Rank(self, rank)


class _Rank:
    def __init__(self, group: ThreadRanks, rank: int) -> None:
        self.group = group
        self.rank = rank

    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        self.group.given[self.rank] = x.clone()
        self.group.barrier.wait()  # every rank has given its own
        return torch.stack(self.group.given)  # type: ignore[arg-type]


def agree(refusals: list[KvPoolUnallocated | None]) -> list[KvPoolUnallocated | None]:
    """Each rank's answer when rank r's own allocation gave refusals[r]."""
    group = ThreadRanks(len(refusals))
    with ThreadPoolExecutor(len(refusals)) as ranks:
        return list(
            ranks.map(lambda rank: first_refusal(group.rank(rank), refusals[rank]), range(len(refusals)))
        )


def said(refused: KvPoolUnallocated | None) -> tuple | None:
    return None if refused is None else (refused.rank, refused.num_blocks, refused.num_bytes, refused.cause)


def test_a_group_whose_pools_all_fit_agrees_on_no_refusal() -> None:
    assert agree([None, None, None]) == [None, None, None]


def test_a_refusal_on_rank_1_is_every_ranks_with_its_blocks_bytes_and_cause() -> None:
    refused = KvPoolUnallocated(4096, 3 * 2**40, "[Errno 12] Cannot allocate memory")
    answers = agree([None, refused])
    assert [said(answer) for answer in answers] == [
        (1, 4096, 3 * 2**40, "[Errno 12] Cannot allocate memory")
    ] * 2


def test_the_lowest_refusing_rank_is_the_one_every_rank_reports() -> None:
    answers = agree([None, None, KvPoolUnallocated(2, 20, "two"), KvPoolUnallocated(3, 30, "three")])
    assert {said(answer) for answer in answers} == {(2, 2, 20, "two")}


def test_rank_0s_own_refusal_names_its_rank() -> None:
    answers = agree([KvPoolUnallocated(8, 80, "out of memory"), None])
    assert [said(answer) for answer in answers] == [(0, 8, 80, "out of memory")] * 2


def test_a_long_cause_is_cut_at_max_cause_bytes_even_inside_a_character() -> None:
    cause = "CUDA out of memory. " + "é" * MAX_CAUSE_BYTES  # two bytes each: the cut splits one
    (answer, _) = agree([KvPoolUnallocated(2, 20, cause), None])
    assert answer is not None
    assert answer.cause.startswith("CUDA out of memory. éé")
    assert len(answer.cause.encode()) <= MAX_CAUSE_BYTES + 2  # the split character's replacement


def test_rank_0_failing_before_its_pool_stops_every_other_rank_at_the_agreement() -> None:
    """Rank 0's set-up failed (say_failed): the others raise RankZeroFailed there, before any step,
    even a rank whose own pool was refused (rank 0 reports nothing of it: it has failed)."""
    group = ThreadRanks(3)
    refused = KvPoolUnallocated(4096, 2**40, "[Errno 12] Cannot allocate memory")
    with ThreadPoolExecutor(3) as ranks:
        failing = ranks.submit(say_failed, group.rank(0))
        others = [ranks.submit(first_refusal, group.rank(r), own) for r, own in ((1, None), (2, refused))]
        failing.result()
        for other in others:
            with pytest.raises(RankZeroFailed, match="rank 0 failed before the KV pool's agreement"):
                other.result()


def test_rank_0_saying_it_failed_waits_a_bounded_time_for_ranks_still_loading() -> None:
    """A large model loads for minutes, which rank 0's error, and a local group's end, waited out."""

    class Recording:
        rank = 0
        within: list[float | None] = []

        def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
            self.within.append(within_s)
            return x.unsqueeze(0)

    group = Recording()
    say_failed(group)
    assert group.within == [SAY_FAILED_WAIT_S]
