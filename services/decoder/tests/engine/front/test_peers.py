"""Rank 0's side of its group's start and end: the KV pool's agreement met once, the other ranks told
to stop where they wait (in the agreement, or in their step loops), each thing said once."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from tandem.decoder.engine.front.peers import RankZeroPeers
from tandem.decoder.engine.step.kv_pool_agreement import FAILED, SAY_FAILED_WAIT_S, _message
from tandem.decoder.models.kv_pool import KvPoolUnallocated


class _Feed:
    """The other ranks' feed: what rank 0 told their step loops."""

    def __init__(self, error: Exception | None = None) -> None:
        self.said: list[str] = []
        self._error = error

    def stop(self) -> None:
        self._say("STOP")

    def abort(self) -> None:
        self._say("ABORT")

    def _say(self, word: str) -> None:
        self.said.append(word)
        if self._error is not None:
            raise self._error


class _Group:
    """A group of two ranks, rank 1 answering each gather with `theirs`, or its gather failing."""

    rank = 0
    world_size = 2
    timeout_s = 60.0

    def __init__(self, theirs: KvPoolUnallocated | None = None, error: Exception | None = None) -> None:
        self.feed = _Feed()
        self.gathered: list[tuple[int, float | None]] = []  # (rank 0's status, its wait) per gather
        self._theirs = _message(theirs)
        self._error = error

    def step_sender(self) -> _Feed:
        return self.feed

    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        self.gathered.append((int(x[0]), within_s))
        if self._error is not None:
            raise self._error
        return torch.stack([x, self._theirs])


class _Thread:
    """The engine thread's `run`, here on the test's own thread."""

    def run(self, fn: Callable[..., object], *args: object) -> object:
        return fn(*args)


def test_one_rank_has_no_feed_and_nothing_to_tell() -> None:
    peers = RankZeroPeers(None)
    refused = KvPoolUnallocated(8, 1 << 20, "Cannot allocate memory")
    assert peers.feed is None
    assert peers.agree_on_pool(_Thread(), refused) is refused  # no gather: this rank's is the verdict
    peers.set_up_failed(_Thread())
    peers.stop(failed=True)


def test_after_an_agreed_pool_the_others_are_stopped_once() -> None:
    group = _Group()
    peers = RankZeroPeers(group)
    assert peers.agree_on_pool(_Thread(), None) is None
    peers.stop(failed=False)
    peers.stop(failed=False)  # a second shutdown sends nothing
    assert group.feed.said == ["STOP"]


def test_a_failed_rank_zero_aborts_the_others_step_loops() -> None:
    group = _Group()
    peers = RankZeroPeers(group)
    peers.agree_on_pool(_Thread(), None)
    peers.stop(failed=True)
    assert group.feed.said == ["ABORT"]


def test_another_ranks_refused_pool_is_the_groups_and_leaves_nothing_to_stop() -> None:
    group = _Group(theirs=KvPoolUnallocated(8, 1 << 20, "Cannot allocate memory"))
    peers = RankZeroPeers(group)
    refused = peers.agree_on_pool(_Thread(), None)
    assert refused is not None and refused.rank == 1 and refused.cause == "Cannot allocate memory"
    peers.set_up_failed(_Thread())  # met already: never a second gather
    peers.stop(failed=True)  # they stop by themselves at a refusal: not listening
    assert [status for status, _ in group.gathered] == [0] and group.feed.said == []


def test_a_set_up_failing_before_the_agreement_says_so_there_once_and_waits_briefly() -> None:
    group = _Group()
    peers = RankZeroPeers(group)
    peers.set_up_failed(_Thread())
    assert group.gathered == [(FAILED, SAY_FAILED_WAIT_S)]
    peers.stop(failed=True)  # never reached their step loops
    assert group.feed.said == []


@pytest.mark.parametrize("error", [TimeoutError("not there yet"), RuntimeError("a rank gone")])
def test_ranks_that_cannot_be_told_are_logged_not_raised(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        RankZeroPeers(_Group(error=error)).set_up_failed(_Thread())
        group = _Group()
        group.feed = _Feed(error=error)
        peers = RankZeroPeers(group)
        peers.agree_on_pool(_Thread(), None)
        peers.stop(failed=False)
    assert group.feed.said == ["STOP"]
    assert caplog.text.count("the other ranks") == 2
