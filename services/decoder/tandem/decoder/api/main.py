"""`tandem serve decoder` / `python -m tandem.decoder`: load the model, serve until SIGTERM.

Start-up, in order, each failure one line and an exit code (2: a flag or variable is wrong, a port
in use included; 1: the weights could not be loaded, or --encoder serves another model): the flags
and `TANDEM_*` variables (`options.py`), the device, the port, the model (a GGUF file is imported
once), the checkpoint's files and whether the world size shards it. Only then does the server listen,
health NOT_SERVING, while the weights load; SERVING once loaded and, with --encoder, once the encoder
says it serves the same model (`encoder_parts.py`: another one is refused), or it has not answered
within ENCODER_CHECK_S.

Stopping (SIGTERM or SIGINT; a second signal only says it is already draining): health NOT_SERVING,
no new calls, and open streams get --grace-s to finish. Any still open then end with
FINISH_REASON_ABORTED, so every stream gets its `finished` event and its span is exported. A signal
while the model still loads (weights, kernel choice, warm-up) ends the process at once (exit 0), the
load abandoned rather than waited for and the ranks this process spawned ended with it; one while
the --encoder's model is checked stops without waiting for its answer. Spawned ranks ignore SIGINT,
so a terminal's Ctrl-C, which reaches them all, is rank 0's alone to act on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn

import click
import torch

from tandem.client.addresses import channel_target
from tandem.client.errors import ConfigError
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
from tandem.client.telemetry import Telemetry, setup_telemetry
from tandem.common.flags import CONTEXT_SETTINGS, FlagError, flag_error, run
from tandem.common.listening import check_port_free
from tandem.common.server import (
    RunningServer,
    Service,
    notice_within,
    start_server,
    stop_on_signals,
)
from tandem.common.startup_heap import freeze_startup_heap, thaw_startup_heap
from tandem.common.torch_part.model_cache import is_gguf_file, resolve_model
from tandem.decoder.api.encoder_parts import EncoderMismatch, EncoderParts
from tandem.decoder.api.options import config_from_options, settings
from tandem.decoder.api.servicer import DecoderServicer
from tandem.decoder.api.token_table import checkpoint_sample, checkpoint_weight_samples
from tandem.decoder.backends.backend import BackendUnavailable, check_available, resolve
from tandem.decoder.backends.cpu.kernel_choice import check_kernels
from tandem.decoder.backends.cpu.kernel_options import AUTO as AUTO_KERNELS
from tandem.decoder.backends.xla.host_pool import check_host_pool
from tandem.decoder.backends.xla.runtime import check_device_count
from tandem.decoder.config import DecoderConfig
from tandem.decoder.distributed.parallel import RankInfo, init_parallel
from tandem.decoder.distributed.worker import (
    join_local_ranks,
    rank_config,
    rank_info,
    run_worker,
    spawn_local_ranks,
)
from tandem.decoder.engine.admission.template_source import TemplateRefused, check_template
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import FinishReason
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused
from tandem.decoder.engine.step.sizing import (
    check_sliding_window,
    max_model_len,
    num_kv_blocks,
    pool_refused,
    static_shapes,
)
from tandem.decoder.engine.step.xla_buckets import XlaBuckets
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.kv_pool import KvPoolUnallocated
from tandem.decoder.models.loader import ModelLoadError, check_checkpoint
from tandem.decoder.models.peft_adapter import AdapterError, read_adapter
from tandem.decoder.models.quantized import check_group
from tandem.decoder.models.quantized_shards import check_cuttable
from tandem.decoder.models.tensor_parallel import check_shardable

log = logging.getLogger("tandem.decoder")

PROG = "tandem serve decoder"
CUT_S = 5.0  # after the grace period: how long aborted streams get to send `finished` before gRPC cancels
# A decoder that stops before it serves has no stream to drain, but a client may have a health call in
# flight: a probe's Check (`tandem wait`, `tandem up`, a kubelet) that the loop, busy beside the load,
# has not answered yet. stop(0) cancels it, and gRPC tells each connected client so with a GOAWAY that
# carries an error, which every client's gRPC core prints on its terminal ("Got goaway [2] ...
# Cancelling all calls"). A graceful stop answers it (NOT_SERVING) and sends a plain GOAWAY; with
# nothing in flight it returns at once, and a health Watch, which never ends by itself, is cut after it.
UNSERVED_GRACE_S = 1.0
# Once loaded, how long the decoder waits for its --encoder to say which model it serves (under `tandem
# up` both start together, and a larger encoder may still be loading); past it, it serves, and the
# encoder's model is checked at its first encoder part.
ENCODER_CHECK_S = 30.0
# Spawned ranks still loading when a signal abandons the load: how long each gets to die of SIGTERM
# before it is killed.
RANK_EXIT_S = 5.0
# Rank 0 failed: how long its spawned ranks get to exit by themselves (one told ABORT does within
# milliseconds) before the rest are ended.
FAILED_RANK_EXIT_S = 1.0


class Outcome(enum.Enum):
    """How `serve` ended, which decides how the process exits."""

    STOPPED = "stopped"  # served (or stopped before serving), everything joined: exit 0
    FAILED = "failed"  # the load, the --encoder check or the group failed: exit 1
    # A signal came while the model loaded: all is closed but the thread loading it, which nothing
    # can interrupt (it is inside safetensors, torch or a kernel's warm-up), so the process exits 0
    # without joining it.
    ABANDONED = "abandoned"


def command() -> click.Command:
    return click.Command(
        "decoder",
        params=settings(),
        callback=_start,
        help="Serve tandem.v1.Decoder: prompts of text, token IDs and embeddings in, streamed tokens out.",
        context_settings=CONTEXT_SETTINGS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run(command(), argv, PROG)


def config_from_args(argv: Sequence[str]) -> DecoderConfig:
    """The config `tandem serve decoder ARGV` runs: flags, then TANDEM_* variables, then defaults.

    Raises click.UsageError for a value that does not parse and ConfigError for one the config refuses.
    """
    with command().make_context(PROG, list(argv)) as ctx:
        return config_from_options(ctx.params)


def _start(**values: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decoder %(levelname)s %(message)s")
    ctx = click.get_current_context()
    try:
        config, rank = _checked_config(values)
    except ConfigError as error:
        raise flag_error(ctx.command, error) from None
    except BackendUnavailable as error:  # e.g. --device neuron without torch-neuronx: what to install
        raise FlagError(str(error)) from None
    try:
        return _serve_ranks(config, rank)
    except ConfigError as error:  # the port, taken since it was checked
        raise flag_error(ctx.command, error) from None


def _checked_config(values: dict[str, Any]) -> tuple[DecoderConfig, RankInfo | None]:
    """Everything that can be checked before listening, cheapest first. Raises ConfigError."""
    config = config_from_options(values)
    check_available(config.engine.device)
    rank = rank_info(config, os.environ)  # None: one rank, no process group
    if rank is None or rank.rank == 0:  # only rank 0 listens (under torchrun every rank starts here)
        check_port_free(config.server.host, config.server.port)
    model = Path(config.engine.model_dir)
    config = with_checkpoint_dir(config)
    check_model(config, 1 if rank is None else rank.world_size, gguf_file=None if model.is_dir() else model)
    if config.encoder_address:
        try:
            channel_target(config.encoder_address)
        except ValueError as error:
            raise ConfigError("encoder_address", f": {error}") from None
    check_cpu_kernels(config)
    return config, rank


def check_cpu_kernels(config: DecoderConfig) -> None:
    """A build named by --cpu-kernels runs on this CPU and loads (where it would be used). Raises
    ConfigError."""
    engine = config.engine
    uses_them = resolve(engine.device).has_cpu_executor and engine.native_kernels and not engine.compile
    if engine.cpu_kernels != AUTO_KERNELS and uses_them:
        check_kernels(engine.cpu_kernels)


def with_checkpoint_dir(config: DecoderConfig) -> DecoderConfig:
    """The config with --model resolved to a checkpoint directory (a GGUF file is imported once).

    Runs before the server starts and before other ranks spawn, so a bad file fails fast with one line
    and every rank reads the same directory. Raises ConfigError.
    """
    source = Path(config.engine.model_dir)
    try:
        model_dir = resolve_model(source, config.engine.dtype, say=log.info)
    except ValueError as error:  # ModelNotFound, GGUFImportError
        raise ConfigError("model_dir", f": {error}") from None
    quantized_from = None
    if config.engine.quantization == "gguf":
        if not is_gguf_file(source):
            raise ConfigError(
                "quantization", f"gguf needs --model to be a GGUF file, got the directory {source}"
            )
        quantized_from = source
    engine = dataclasses.replace(config.engine, model_dir=model_dir, quantized_from=quantized_from)
    return dataclasses.replace(config, engine=engine)


def check_model(config: DecoderConfig, world_size: int, gguf_file: Path | None = None) -> None:
    """The checkpoint has what loading needs and `world_size` shards it; no weight is read.
    `gguf_file`: the file --model named, which `config`'s model_dir was imported from."""
    engine = config.engine
    model_config = check_fits(
        engine.model_dir,
        engine.dtype,
        engine.quantization,
        engine.quantization_group_size,
        world_size,
        gguf_file=gguf_file,
    )
    check_sliding_window(engine, model_config)  # a window narrower than --max-model-len is refused
    num_blocks = num_kv_blocks(engine, model_config, world_size)  # past what a pool may address
    is_xla = resolve(engine.device).placement == "xla"
    if is_xla:
        check_device_count(engine.num_devices)  # the user's CPU_NUM_DEVICES, another count
        try:  # the pool's copies on XLA's CPU device, past the host's memory
            check_host_pool(model_config, num_blocks, engine.block_size, engine.num_devices, os.environ)
        except KvPoolUnallocated as error:
            raise pool_refused(engine, error) from None
    # The buckets the engine will build, for the context it will serve: too small, or past every step.
    context = max_model_len(engine, model_config, num_blocks)
    configured = max_model_len(engine, model_config)  # before the pool's cap: what widths may reach
    if is_xla:
        XlaBuckets.from_config(engine, context, engine.num_devices, configured)
    else:
        static_shapes(engine, context, configured)
    for name, path in engine.loras:  # read once here too, so a bad adapter fails before listening
        try:
            read_adapter(path, model_config, engine.max_lora_rank)
        except AdapterError as error:
            raise ConfigError("loras", f": adapter {name!r}: {error}") from None


def check_fits(
    model_dir: str | Path,
    dtype: str,
    quantization: str,
    quantization_group_size: int,
    world_size: int,
    gguf_file: Path | None = None,
) -> ModelConfig:
    """The checkpoint in `model_dir` loads in `dtype`, its chat template compiles, `quantization`
    rounds it and `world_size` shards it; no weight is read (`tandem up` asks before it starts the
    decoder). `gguf_file`: the GGUF file `model_dir` was imported from, which a refusal of its
    template names (its `tokenizer.chat_template`) rather than the import's copy in the model cache.
    Returns the model's config; raises ConfigError naming the field at fault."""
    try:
        model_config = check_checkpoint(model_dir, dtype)
        # In a template worker: compiling runs some of the template.
        check_template(Path(model_dir), gguf_file=gguf_file)
    except (ModelLoadError, TemplateRefused) as error:
        raise ConfigError("model_dir", f": {error}") from None
    if quantization != "none":
        try:
            check_group(model_config, quantization_group_size)
        except ValueError as error:
            field = "quantization_group_size" if quantization == "int4" else "quantization"
            raise ConfigError(field, f"{quantization} cannot quantize this checkpoint: {error}") from None
    if world_size > 1:
        try:
            check_shardable(model_config, world_size)
        except ValueError as error:
            raise ConfigError("world_size", f": {error}") from None
        if quantization != "none":
            try:
                check_cuttable(model_config, world_size)
            except ValueError as error:
                raise ConfigError(
                    "world_size", f": {quantization} weights cannot be sharded: {error}"
                ) from None
    return model_config


def _serve_ranks(config: DecoderConfig, rank: RankInfo | None) -> int:
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


async def serve(
    config: DecoderConfig, ready: asyncio.Event | None = None, rank: RankInfo | None = None
) -> Outcome:
    """Serves until SIGTERM; with `rank` (several ranks) also until the group fails."""
    telemetry = setup_telemetry("tandem-decoder", os.environ)  # OTEL_*; off when nothing is configured
    servicer = DecoderServicer(
        config.model_name,
        config.server.max_message_bytes,
        config.world_size,
        telemetry=telemetry,
        max_streams_per_connection=config.max_streams_per_connection,
        identify_by_token=bool(config.server.auth_tokens),
        max_streams_per_token=config.max_streams_per_token,
    )
    interceptors = (*config.server.interceptors, *telemetry.server_interceptors())
    running = await start_server(
        dataclasses.replace(config.server, interceptors=interceptors),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    stop = stop_on_signals(config.server.grace_s, log)
    log.info("loading %s (health NOT_SERVING until ready)", config.engine.model_dir)
    # Its own thread, not the loop's default executor, which asyncio.run would join on the way out.
    loader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-load")
    loading = asyncio.get_running_loop().run_in_executor(loader, _load_engine, config, rank)
    is_loaded = await _unless_stopped(loading, stop)
    loader.shutdown(wait=False)
    if not is_loaded:
        log.info("stopping before the model finished loading")
        await running.stop(UNSERVED_GRACE_S)
        telemetry.shutdown()
        log.info("stopped")
        return Outcome.ABANDONED
    try:
        engine = loading.result()
    except ConfigError:  # e.g. a KV pool the host cannot hold: one line naming the flag, as before listening
        await running.stop(UNSERVED_GRACE_S)
        telemetry.shutdown()
        raise
    except (ModelLoadError, BackendUnavailable, OSError, RuntimeError, ValueError) as error:
        log.error("could not load %s: %s", config.engine.model_dir, error)
        log.debug("the load failed here", exc_info=True)
        await running.stop(UNSERVED_GRACE_S)
        telemetry.shutdown()
        return Outcome.FAILED
    # This thread only converts requests (small tensor ops): one intra-op thread, so it never holds
    # an OpenMP team that would slow the engine thread's steps.
    torch.set_num_threads(1)
    servicer.token_table_sample = checkpoint_sample(Path(config.engine.model_dir))  # 16 rows read
    servicer.weight_samples = checkpoint_weight_samples(Path(config.engine.model_dir))  # 16 rows a tensor
    if config.encoder_address:
        servicer.encoder_parts = EncoderParts(
            config.encoder_address,
            engine.model_config.dtype,
            config.server.max_message_bytes,
            config.encoder_cache_bytes,
            telemetry,
            model_dir=Path(config.engine.model_dir),
            model_name=config.model_name,
            hidden_size=engine.model_config.hidden_size,
        )
        log.info("encoder parts are fetched from %s", config.encoder_address)
        checking = asyncio.ensure_future(servicer.encoder_parts.check_model(ENCODER_CHECK_S))
        if not await _unless_stopped(checking, stop):  # the encoder may still be loading: not waited for
            checking.cancel()
            await asyncio.wait({checking})
            log.info("stopping before the encoder's model was checked")
            return await _stop_unserved(engine, servicer, running, telemetry, Outcome.STOPPED)
        try:
            log.info("%s", checking.result())
        except EncoderMismatch as error:
            log.error("refusing --encoder: %s", error)
            return await _stop_unserved(engine, servicer, running, telemetry, Outcome.FAILED)
    if stop.is_set():  # the signal came as the load ended: stop without serving a moment
        log.info("stopping before serving")
        return await _stop_unserved(engine, servicer, running, telemetry, Outcome.STOPPED)
    servicer.engine = engine
    freeze_startup_heap()
    await running.set_serving()
    log.info("serving %s on port %d", config.model_name, running.port)
    if ready is not None:
        ready.set()
    # A failed group cannot recover: rank 0 then stops too, so the whole group exits non-zero.
    watchdog = asyncio.create_task(_watch_engine(engine, running, stop if rank is not None else None))
    await stop.wait()
    healthy = engine.is_healthy
    watchdog.cancel()
    await drain(running, engine, config.server.grace_s)
    engine.shutdown()
    thaw_startup_heap()
    if servicer.encoder_parts is not None:
        await servicer.encoder_parts.close()
    telemetry.shutdown()  # flushes spans and metrics still buffered
    log.info("stopped")
    return Outcome.STOPPED if healthy else Outcome.FAILED


async def _unless_stopped(work: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Waits for `work` until `stop` is set; True when `work` is done (it is left running if not)."""
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    return work.done()


async def _stop_unserved(
    engine: Engine, servicer: DecoderServicer, running: RunningServer, telemetry: Telemetry, outcome: Outcome
) -> Outcome:
    """Closes a loaded engine that never served (no call reached it): nothing to drain."""
    engine.shutdown()
    if servicer.encoder_parts is not None:
        await servicer.encoder_parts.close()
    await running.stop(UNSERVED_GRACE_S)
    telemetry.shutdown()
    log.info("stopped")
    return outcome


async def drain(running: RunningServer, engine: Engine, grace_s: float) -> None:
    """No new calls; open streams get `grace_s` to finish, then end with FINISH_REASON_ABORTED.

    gRPC itself would cancel what is left at the deadline (callers see UNAVAILABLE and the spans are
    lost), so its deadline is CUT_S later: by then every aborted stream has sent its `finished`.
    """
    # The notice within `grace_s`, not its cut: a Generate taken after `grace_s` would not be ended
    # by finish_all below and would run until gRPC's cut.
    stopping = asyncio.ensure_future(running.stop(grace_s + CUT_S, notice_s=notice_within(grace_s)))
    done, _ = await asyncio.wait({stopping}, timeout=grace_s)
    if not done:
        num_aborted = engine.finish_all(FinishReason.ABORTED)
        log.info("grace period over: %d open requests end with FINISH_REASON_ABORTED", num_aborted)
    await stopping


def _load_engine(config: DecoderConfig, rank: RankInfo | None) -> Engine:
    tp = None if rank is None else init_parallel(rank, config.engine.device, config.collective_timeout_s)
    return Engine(config.engine, tp=tp).start()


async def _watch_engine(engine: Engine, running, stop: asyncio.Event | None = None) -> None:
    """An engine fault fails its open streams at once; this also takes the server out of rotation."""
    while engine.is_healthy:
        await asyncio.sleep(0.5)
    log.error("engine failed: health NOT_SERVING")
    await running.set_serving(False)
    if stop is not None:
        stop.set()
