"""Runs a function on N spawned gloo ranks and returns each rank's result; nothing outlives the call.

Each rank is a fresh interpreter (spawn) with one torch thread, joined into a group on a free loopback
port. A rank that raises, or a group that does not finish within `timeout_s`, fails the call, and
every rank is killed before it returns.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.decoder.distributed.parallel import ParallelContext, RankInfo, free_port, init_parallel

RankFn = Callable[..., Any]  # fn(tp, *args) -> a picklable result


def run_ranks(fn: RankFn, world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """fn(tp, *args) on ranks 0..world_size-1; returns the results in rank order."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    port = free_port()
    infos = [RankInfo.local(rank, world_size, port) for rank in range(world_size)]
    processes = [context.Process(target=_rank_main, args=(fn, info, args, results)) for info in infos]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise AssertionError(f"ranks {missing} timed out after {timeout_s} s") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            outcomes[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(5 if len(outcomes) == world_size else 0)
            if process.is_alive():
                process.kill()
                process.join()
    return [outcomes[rank] for rank in range(world_size)]


def _rank_main(fn: RankFn, info: RankInfo, args: tuple, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    try:
        tp: ParallelContext = init_parallel(info, "cpu", timeout_s=30)
        # Plain pickle bytes: torch's queue pickling shares tensors through file descriptors that
        # would die with this process.
        results.put((info.rank, True, pickle.dumps(fn(tp, *args))))
    except Exception:
        results.put((info.rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()  # the result is in the pipe; the interpreter's slow teardown is not needed
    os._exit(0)


@dataclass(frozen=True)
class FakeRank:
    """One rank as the model's slicing reads it (the rank, also as a tensor); no process group behind it."""

    rank: int
    world_size: int

    @property
    def rank_tensor(self) -> torch.Tensor:
        return torch.tensor(self.rank)
