"""Whether every rank of a group allocated its KV pool: a refusal on any rank is the group's start error.

NOTE: why every rank says so. Each rank allocates its own share of the pool, and a rank but 0 that
could not ended alone: a traceback and exit 1 of its own, while rank 0 learned of it only when its
next collective failed ("could not load", exit 1), naming no flag and no size. Rank 0 speaks for the
group (it is the process the user started), so every rank tells every other one, once, right after
its pool's allocation: whether it was refused, the blocks and bytes asked and the allocator's words.
Then every rank knows the same first refusal (the lowest rank's), rank 0 says it as the flag's error
(exit 2) and the others stop without a traceback. Every rank gathers at the same point, before any
step is sent on the control group, so the gather is matched on each; a rank that dies before it
fails the others' gather instead, as any collective of a dead group does. Rank 0 failing before it
(loading, its chat template, anything of its set-up) still takes part, saying so (say_failed): the
others stop there (RankZeroFailed) instead of waiting out the group timeout (rank_zero_failed.py).

The message: int64 [HEADER + MAX_CAUSE_BYTES] of the status (ALLOCATED, REFUSED, FAILED), num_blocks,
num_bytes, the cause's length, then the cause's UTF-8 bytes one per element. Plain integers, no
pickles: the ranks' wire carries none (step_broadcast.py). Start-up's one message, so its 4 KiB cost
nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.client.errors import ConfigError
from tandem.decoder.engine.step.rank_zero_failed import RankZeroFailed
from tandem.decoder.models.kv_pool import KvPoolUnallocated

# status, num_blocks, num_bytes, the cause's length in bytes
HEADER = 4
# The status: this rank's pool allocated; refused (the other fields say how); this rank failed before
# its pool (rank 0 only: another rank that fails exits, which fails the gather).
ALLOCATED, REFUSED, FAILED = 0, 1, 2
# The cause's bytes carried, cut there: mmap's ENOMEM says 25, the host memory check ~60, CUDA's
# out-of-memory message ~400 with its advice on the allocator's settings.
MAX_CAUSE_BYTES = 512
# How long rank 0 whose set-up failed waits for the others to reach the agreement: they may load for
# minutes (a large model), which its error, and a local group's end, waited out.
SAY_FAILED_WAIT_S = 1.0


class KvPoolRefused(ConfigError):
    """The start error of the flag that sized a KV pool some rank could not allocate (sizing.pool_refused).

    Its own class because on a group it means more than any other flag's error: every rank has agreed
    on it (first_refusal) and is stopping by itself, so rank 0 waits for the ranks it spawned to exit
    and a rank but 0 exits 2 quietly, leaving the line to rank 0. Any other ConfigError met while the
    ranks load (the port taken since it was checked, a fault on one rank) is one rank's alone: the
    others still load, or wait in a collective, and must be ended, or end with the error in their log.
    """


class ControlGather(Protocol):
    """What the agreement needs of a rank's group: the decoder passes `parallel.ParallelContext`."""

    rank: int  # this rank, 0-based

    # Every rank's host tensor, stacked in rank order: [world_size, *x.shape]. `within_s`: this rank
    # waits that long at most, raising TimeoutError (the gather stays queued).
    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor: ...


def first_refusal(group: ControlGather, refused: KvPoolUnallocated | None) -> KvPoolUnallocated | None:
    """The lowest rank's refusal, the same on every rank, with its rank set; None if every rank's pool
    was allocated. `refused`: this rank's own refusal, None if its pool was allocated. Raises
    RankZeroFailed when rank 0 failed before its pool (say_failed)."""
    every = group.all_gather_control(_message(refused))  # [world_size, HEADER + MAX_CAUSE_BYTES]
    if every[0, 0] == FAILED:
        raise RankZeroFailed("rank 0 failed before the KV pool's agreement")
    for rank, (status, num_blocks, num_bytes, num_cause_bytes, *cause) in enumerate(every.tolist()):
        if status == REFUSED:
            said = bytes(cause[:num_cause_bytes]).decode(errors="replace")  # a cut may split a character
            return KvPoolUnallocated(num_blocks, num_bytes, said, rank=rank)
    return None


def say_failed(group: ControlGather) -> None:
    """Rank 0's part in the agreement when its set-up failed before it: the others stop there. Raises
    TimeoutError when some rank has not reached it within SAY_FAILED_WAIT_S; a rank that reaches it
    while rank 0 lives (a local group's rank 0 waits for its ranks, or ends them) is still told."""
    message = _message(None)
    message[0] = FAILED
    group.all_gather_control(message, within_s=SAY_FAILED_WAIT_S)


def _message(refused: KvPoolUnallocated | None) -> torch.Tensor:
    """int64 [HEADER + MAX_CAUSE_BYTES]: this rank's refusal as the module's NOTE lays it out."""
    message = torch.zeros(HEADER + MAX_CAUSE_BYTES, dtype=torch.int64)  # ALLOCATED
    if refused is not None:
        cause = refused.cause.encode()[:MAX_CAUSE_BYTES]
        header = [REFUSED, refused.num_blocks, refused.num_bytes, len(cause)]
        message[: HEADER + len(cause)] = torch.tensor(header + list(cause), dtype=torch.int64)
    return message
