"""This process's ranks around rank 0's `serve`, and how the process exits by its outcome.

Rank 0 spawns ranks 1..N-1 (unless torchrun started them), serves, and then joins them, or ends them
where it failed or abandoned their load. Spawned ranks ignore SIGINT, so a terminal's Ctrl-C, which
reaches them all, is rank 0's alone to act on. A signal while the model still loads ends the process
at once (exit 0), the load abandoned rather than waited for and the ranks this process spawned ended
with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from typing import NoReturn

from tandem.client.errors import ConfigError
from tandem.decoder.api.serving import Outcome, serve
from tandem.decoder.config import DecoderConfig
from tandem.decoder.distributed.parallel import RankInfo
from tandem.decoder.distributed.worker import join_local_ranks, rank_config, run_worker, spawn_local_ranks
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused

log = logging.getLogger("tandem.decoder")

# Spawned ranks still loading when a signal abandons the load: how long each gets to die of SIGTERM
# before it is killed.
RANK_EXIT_S = 5.0
# Rank 0 failed: how long its spawned ranks get to exit by themselves (one told ABORT does within
# milliseconds) before the rest are ended.
FAILED_RANK_EXIT_S = 1.0


def serve_ranks(config: DecoderConfig, rank: RankInfo | None) -> int:
    """Serves on this process's rank (`rank` None: the only one); the process's exit code."""
    if rank is None:
        outcome = asyncio.run(serve(config))
    else:
        config = rank_config(config, rank)
        if rank.rank != 0:
            return run_worker(rank, config)
        workers = [] if rank.is_torchrun else _spawn_ranks(config, rank)
        try:
            outcome = asyncio.run(serve(config, rank=rank))
        except KvPoolRefused:  # every rank has agreed on it and is stopping by itself (kv_pool_agreement.py)
            join_local_ranks(workers, RANK_EXIT_S)
            raise
        except ConfigError:  # e.g. the port, taken since it was checked: rank 0's alone, the ranks still load
            _end_loading_ranks(workers)
            raise
        except BaseException:  # a bug, an OSError, a KeyboardInterrupt: no rank outlives rank 0 as an orphan
            # Whether they still load or were told to stop (serve shuts its engine down whatever ended
            # it), as for a rank 0 that failed: a told rank exits by itself, the rest are ended.
            _end_failed_ranks(workers)
            raise
        if outcome is Outcome.ABANDONED:
            _end_loading_ranks(workers)
        elif outcome is Outcome.FAILED:
            _end_failed_ranks(workers)
        elif not join_local_ranks(workers, config.collective_timeout_s):
            outcome = Outcome.FAILED
    if outcome is Outcome.ABANDONED:
        _exit_leaving_the_load()
    if outcome is Outcome.FAILED and rank is not None:
        _exit_failed()
    return 0 if outcome is Outcome.STOPPED else 1


def _spawn_ranks(config: DecoderConfig, rank: RankInfo) -> list[BaseProcess]:
    """Ranks 1..N-1, started with SIGINT ignored, a disposition their fresh interpreters keep (Python
    installs KeyboardInterrupt only over the default one). A terminal's Ctrl-C reaches every process
    of its group: each rank died of it mid-load or mid-step, a traceback each, and the group exited 1
    where rank 0 alone should act on it, draining its streams and then stopping the ranks (or, while
    they load, ending them). SIGTERM still ends a rank. A Ctrl-C during the spawn itself (milliseconds)
    is lost."""
    default = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return spawn_local_ranks(config, rank)
    finally:
        signal.signal(signal.SIGINT, default)


def _end_loading_ranks(processes: list[BaseProcess]) -> None:
    """Ends the ranks this process spawned while they load. Nothing can tell them to stop (the step
    feed that carries STOP exists once the engine is built), and a rank left behind would hold its
    memory until the group's timeout failed it; they keep Python's default action for SIGTERM."""
    for process in processes:
        process.terminate()
    join_local_ranks(processes, RANK_EXIT_S)  # reaps them; kills one SIGTERM did not end


def _end_failed_ranks(processes: list[BaseProcess]) -> None:
    """Ends the ranks this process spawned once it failed. One told ABORT exits by itself at once;
    one that no word reaches (inside a step's collectives, still loading) would fail only at the
    group's timeout, and joining it for that long held this exit up to 2 timeouts after its failure."""
    deadline = time.monotonic() + FAILED_RANK_EXIT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    stuck = [process for process in processes if process.is_alive()]
    if stuck:  # their own logs end without a word: this says why they stopped
        names = ", ".join(process.name for process in stuck)
        log.warning("ending %s: still running %.0f s after rank 0 failed", names, FAILED_RANK_EXIT_S)
    for process in stuck:
        process.terminate()
    join_local_ranks(processes, RANK_EXIT_S)  # reaps them; kills one SIGTERM did not end


def _exit_failed() -> NoReturn:
    """Exit 1 now, rank 0 of a group that failed. Its last word to the other ranks may still be queued
    (a rank hung, or inside a step, did not take it within step_broadcast.END_WAIT_S): the interpreter's
    exit then waited for it in the process group's teardown, up to the group timeout (under torchrun,
    whose ranks this process does not end). Everything else is closed by now: the server, the telemetry,
    the engine, the ranks it spawned."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _exit_leaving_the_load() -> NoReturn:
    """Exit 0 now, with the model still loading. Its thread cannot be interrupted and the interpreter's
    exit would join it (and the engine thread it waits on), so a signal during a load of minutes would
    take minutes to act on. Everything else is closed by now: the server, the telemetry, the ranks."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
