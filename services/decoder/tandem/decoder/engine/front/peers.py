"""Rank 0's side of its group's start and end: where the other ranks wait on it, and how they are let go.

NOTE: where they wait (rank_zero_failed.py). The other ranks load, then wait in the KV pool's
agreement, then in their step loops, where rank 0's feed reaches them. A rank 0 that fails must tell
them where they are: in the agreement by saying it failed there, in their loops by ABORT; an end that
is not a failure sends STOP. Each is said once: the agreement is met once, and a second shutdown sends
nothing.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from tandem.decoder.engine.front.loop import EngineThread
from tandem.decoder.engine.step.kv_pool_agreement import first_refusal, say_failed
from tandem.decoder.engine.step.runner import StepFeed
from tandem.decoder.models.kv_pool import KvPoolUnallocated
from tandem.decoder.models.tensor_parallel import ParallelGroup

log = logging.getLogger(__name__)


class RankGroup(ParallelGroup, Protocol):
    """Rank 0's view of its group of ranks; the decoder passes `distributed.parallel.ParallelContext`."""

    timeout_s: float  # a collective waiting longer fails, so idle rank 0 sends keepalives well within it

    def step_sender(self) -> StepFeed: ...  # feeds every step to the other ranks' worker loops

    # Every rank's host tensor, stacked in rank order (start-up's agreements: kv_pool_agreement.py).
    # `within_s`: this rank waits that long at most, raising TimeoutError (kv_pool_agreement.say_failed).
    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor: ...


class RankZeroPeers:
    """The other ranks of rank 0's group, as its set-up and shutdown reach them; one rank has none."""

    def __init__(self, tp: RankGroup | None) -> None:
        self._tp = tp
        # The other ranks' feed, which runs every step and adapter install there too; None: one rank.
        self.feed: StepFeed | None = None if tp is None else tp.step_sender()
        self._at_agreement = tp is not None  # loading, or waiting in the KV pool's agreement
        self._listening = False  # in their step loops, where the feed reaches them

    def agree_on_pool(
        self, thread: EngineThread, refused: KvPoolUnallocated | None
    ) -> KvPoolUnallocated | None:
        """The group's verdict on its KV pools, given this rank's: a refusal on any rank is the group's
        (kv_pool_agreement.py). Met there, failing or not, it is never gathered a second time; agreed,
        the others go on to their step loops."""
        if self._tp is None:
            return refused
        self._at_agreement = False
        refused = thread.run(first_refusal, self._tp, refused)
        self._listening = refused is None
        return refused

    def set_up_failed(self, thread: EngineThread) -> None:
        """The other ranks, loading or waiting in the KV pool's agreement, stop there."""
        if not self._at_agreement:
            return
        assert self._tp is not None
        try:
            thread.run(say_failed, self._tp)
        except TimeoutError:  # still loading: they stop there if they reach it while this process lives
            log.info("the other ranks have not reached the KV pool's agreement yet; not waiting for them")
        except Exception as error:  # a rank already gone: nothing to tell
            log.warning("could not tell the other ranks to stop at the KV pool's agreement: %s", error)

    def stop(self, failed: bool) -> None:
        """The other ranks' worker loops end: STOP, or ABORT when this rank failed (they exit non-zero at
        once; without it they waited out the group timeout). Sent once: a second shutdown sends nothing.
        Either waits 1 s at most (step_broadcast.END_WAIT_S): a rank still inside a step's collectives
        takes it once they end, or fails at the group timeout; a hung one no longer holds this shutdown."""
        if not self._listening:
            return
        assert self.feed is not None
        self._listening = False
        word = "ABORT" if failed else "STOP"
        try:
            if failed:
                self.feed.abort()
            else:
                self.feed.stop()
        except TimeoutError as error:  # left queued: taken later (inside a step), or the rank times out
            log.warning("the other ranks did not take %s at once (inside a step, or hung): %s", word, error)
        except Exception as error:  # a rank gone (or the fault was the group's): nothing to tell
            log.warning("could not send the other ranks %s (one gone?): %s", word, error)
