"""The ranks of a multi-rank decoder: how a group starts, and the loop every rank but 0 runs.

NOTE: the lifecycle. One command starts the group: without torchrun variables, rank 0 (the process
the user started) picks a free loopback port and spawns ranks 1..N-1 on this machine; under torchrun
every process is already a rank. Rank 0 then serves gRPC and runs the engine; the others load their
shard and run `run_worker`: receive a batch, run the same forward, repeat. Nothing waits forever:
every collective has the group timeout, rank 0 sends keepalives while idle, a worker whose rank 0
vanished fails its next receive and exits non-zero, one whose rank 0 failed is sent ABORT and exits
non-zero at once (rank_zero_failed.py), a spawned one whose rank 0 process ended, even by SIGKILL,
exits at once whatever it was doing (`_end_with_rank_zero`), and rank 0 turns any collective failure
into UNAVAILABLE for open streams, NOT_SERVING, and a non-zero exit (see `__main__.serve`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Mapping
from multiprocessing.process import BaseProcess

import torch

from tandem.client.errors import ConfigError
from tandem.common.startup_heap import freeze_startup_heap, thaw_startup_heap
from tandem.decoder.backends import backend as backends
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.distributed.parallel import (
    ParallelContext,
    RankInfo,
    destroy_parallel,
    free_port,
    init_parallel,
)
from tandem.decoder.distributed.step_broadcast import receive_step
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused, first_refusal
from tandem.decoder.engine.step.rank_zero_failed import RankZeroFailed
from tandem.decoder.engine.step.runner import ModelRunner
from tandem.decoder.engine.step.sizing import num_kv_blocks, pool_refused
from tandem.decoder.models.kv_pool import KvPoolUnallocated
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.lora import LoraTable

log = logging.getLogger("tandem.decoder")


def rank_info(config: DecoderConfig, environ: Mapping[str, str]) -> RankInfo | None:
    """This process's place in the group: from torchrun's variables, else rank 0 of a local group.

    None for a single rank (no process group at all). Raises ConfigError on a world-size mismatch.
    """
    if backends.resolve(config.engine.device).is_spmd:
        return None  # its devices are one SPMD program in this process: no process group
    info = RankInfo.from_torchrun(dict(environ))
    if info is not None:
        if config.world_size not in (1, info.world_size):
            raise ConfigError(
                "world_size", f"is {config.world_size} but torchrun's WORLD_SIZE is {info.world_size}"
            )
        return info if info.world_size > 1 else None
    if config.world_size == 1:
        return None
    return RankInfo.local(0, config.world_size, free_port())


def rank_config(config: DecoderConfig, info: RankInfo) -> DecoderConfig:
    """The config as this rank runs it: the group's world size, and its own CUDA device."""
    engine = config.engine
    if engine.device.startswith("cuda") and ":" not in engine.device:
        engine = dataclasses.replace(engine, device=f"cuda:{info.local_rank}")
    return dataclasses.replace(config, engine=engine, world_size=info.world_size)


def spawn_local_ranks(config: DecoderConfig, info: RankInfo) -> list[BaseProcess]:
    """Rank 0 of a local group starts ranks 1..N-1 (fresh interpreters, so no torch state is shared)."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, info.world_size):
        worker_info = dataclasses.replace(info, rank=rank, local_rank=rank)  # same init_method
        process = context.Process(
            target=worker_main, args=(worker_info, config), name=f"tandem-rank-{rank}", daemon=True
        )
        process.start()
        log.info("started rank %d (pid %d)", rank, process.pid)
        processes.append(process)
    return processes


def join_local_ranks(processes: list[BaseProcess], timeout_s: float) -> bool:
    """Waits for spawned ranks to exit, kills any still alive after `timeout_s`; True if all exited 0."""
    ok = True
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            log.error("rank %s did not exit in %.0f s; killing it", process.name, timeout_s)
            process.kill()
            process.join()
        ok = ok and process.exitcode == 0
    return ok


def worker_main(info: RankInfo, config: DecoderConfig) -> None:
    """Entry point of a spawned rank: ends with rank 0, runs the worker loop, then leaves without
    running finalizers."""
    log_format = f"%(asctime)s decoder[{info.rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    _end_with_rank_zero(info.rank)
    code = run_worker(info, rank_config(config, info))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a dead peer must not be able to hold this process in a group destructor


def _end_with_rank_zero(rank: int) -> None:
    """Exits this spawned rank, code 1, as soon as rank 0, the process that spawned it, has ended: a
    daemon thread waits for it.

    NOTE: why. A rank 0 killed (SIGKILL, the OOM killer) says no word, and a rank learned of it only
    from a collective or the rendezvous failing: one waiting for rank 0's store ran on for the group's
    timeout (105 s measured at the default 60 s), one loading its shard to the end of its load, holding
    memory and CPU. It now exits 0.1-0.2 s after the kill; where rank 0 died while this rank's
    interpreter still started (its imports, before this runs), once they are done (5-7 s, 2 busy
    cores). What it watches is multiprocessing's parent sentinel, a pipe whose writing end rank 0 holds
    while this rank runs: it reads end-of-file once rank 0's process has ended, however, and at once
    where it had ended before this thread began, and no thread of rank 0 ending sooner fires it. Not
    PR_SET_PDEATHSIG: that takes ctypes, which the decoder keeps to the CPU backend's kernels
    (tests/unit/test_architecture.py). The thread needs the GIL to act, which the torch calls a rank
    spends its time in (reads, casts, collectives) release.
    """
    parent = multiprocessing.parent_process()
    if parent is None:  # run in the process that called it, not spawned: there is no rank 0 to outlive
        return

    def exit_when_rank_zero_has() -> None:
        parent.join()  # returns once the sentinel reads end-of-file
        log.error("rank %d stopping: rank 0 (pid %s) has exited", rank, parent.pid)
        sys.stderr.flush()
        os._exit(1)  # not the main thread's unwinding: it may be inside a collective or a load

    threading.Thread(target=exit_when_rank_zero_has, name="end-with-rank-0", daemon=True).start()


def run_worker(info: RankInfo, config: DecoderConfig) -> int:
    """Joins the group, then runs rank 0's steps until STOP (returns 0) or a failure (returns 1, rank 0's
    ABORT too; 2 for a KV pool the group agreed it cannot start with: KvPoolRefused)."""
    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)
    try:
        run_steps(init_parallel(info, config.engine.device, config.collective_timeout_s), config.engine)
    except KvPoolRefused as error:
        # A KV pool some rank could not allocate, which every rank has agreed on: rank 0 says it as
        # the flag's one-line error and exits 2; a traceback here would bury that line. Any other
        # error (a ConfigError too) is this rank's alone, which only this rank's log can tell.
        log.info("rank %d stopped: %s", info.rank, error)
        return 2
    except RankZeroFailed:  # said with its traceback in rank 0's log: one line here
        log.error("rank %d stopping: rank 0 failed (its log says why)", info.rank)
        return 1
    except Exception:
        log.exception("rank %d failed; exiting", info.rank)
        return 1
    destroy_parallel()
    log.info("rank %d stopped", info.rank)
    return 0


def run_steps(tp: ParallelContext, config: EngineConfig) -> None:
    """Loads this rank's shard and runs every batch rank 0 sends until STOP; raises on a failure."""
    loaded = load_model(
        config.model_dir,
        config.dtype,
        config.device,
        tp,
        config.quantization,
        config.quantized_from,
        config.quantization_group_size,
    )
    model_config = loaded.config
    # This rank's shard of every LoRA slot, empty until rank 0 sends an adapter (step_broadcast.py).
    lora = (
        LoraTable(model_config, config.max_loras, config.max_lora_rank, loaded.model.device, tp)
        if config.enable_lora
        else None
    )
    backend = backends.resolve(config.device)
    executor = backends.prepare_model(
        loaded.model, backend, config.compile, config.native_kernels, config.kernel_options, lora
    )
    num_blocks = num_kv_blocks(config, model_config, tp.world_size)
    try:
        runner = ModelRunner(loaded.model, num_blocks, config.block_size, executor=executor, lora=lora)
        refused = None
    except KvPoolUnallocated as error:
        refused = error
    refused = first_refusal(tp, refused)  # rank 0 gathers the same (kv_pool_agreement.py)
    if refused is not None:
        raise pool_refused(config, refused) from None
    freeze_startup_heap()  # a full collection here would stall every rank's step (they wait for each other)
    log.info("rank %d of %d ready", tp.rank, tp.world_size)
    try:
        with torch.inference_mode():
            while (
                batch := receive_step(
                    tp.control, model_config.hidden_size, model_config.dtype, runner.device, lora
                )
            ) is not None:
                runner.forward(batch)
    finally:
        thaw_startup_heap()
