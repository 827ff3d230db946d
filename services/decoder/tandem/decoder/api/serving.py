"""The decoder's life as a server: listen (health NOT_SERVING) while the engine loads, check the
--encoder's model, serve, and stop.

SERVING once loaded and, with --encoder, once the encoder says it serves the same model
(`encoder_parts.py`: another one is refused), or it has not answered within ENCODER_CHECK_S.

Stopping (SIGTERM or SIGINT; a second signal only says it is already draining): health NOT_SERVING,
no new calls, and open streams get --grace-s to finish (`drain.py`). A signal while the model still
loads (weights, kernel choice, warm-up) abandons the load rather than waiting for it
(`Outcome.ABANDONED`: `rank_group.py` ends the process and its ranks); one while the --encoder's
model is checked stops without waiting for its answer.

However it ends once the model loaded (a stop, a failure, an error raised on the way), the engine (its
thread would hold the interpreter's exit), the encoder parts, the server and the telemetry are each
released once, a release that raises not keeping the next from its turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from tandem.client.errors import ConfigError
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
from tandem.client.telemetry import Telemetry, setup_telemetry
from tandem.common.running_server import RunningServer
from tandem.common.server import Service, start_server
from tandem.common.startup_heap import freeze_startup_heap, thaw_startup_heap
from tandem.common.stop_signals import stop_on_signals
from tandem.decoder.api.drain import drain
from tandem.decoder.api.encoder_parts import EncoderMismatch, EncoderParts
from tandem.decoder.api.servicer import DecoderServicer
from tandem.decoder.api.token_table import checkpoint_sample, checkpoint_weight_samples
from tandem.decoder.backends.backend import BackendUnavailable
from tandem.decoder.config import DecoderConfig
from tandem.decoder.distributed.parallel import RankInfo, init_parallel
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import ModelLoadError

log = logging.getLogger("tandem.decoder")

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
# A load that raises one of these failed on the checkpoint or this host (ModelLoadError, a short read,
# a NaN, torch's out of memory), not on a bug: one error line, no traceback.
LOAD_FAILURES = (ModelLoadError, BackendUnavailable, OSError, RuntimeError, ValueError)


class Outcome(enum.Enum):
    """How `serve` ended, which decides how the process exits."""

    STOPPED = "stopped"  # served (or stopped before serving), everything joined: exit 0
    FAILED = "failed"  # the load, the --encoder check or the group failed: exit 1
    # A signal came while the model loaded: all is closed but the thread loading it, which nothing
    # can interrupt (it is inside safetensors, torch or a kernel's warm-up), so the process exits 0
    # without joining it.
    ABANDONED = "abandoned"


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
        await _in_turn(lambda: running.stop(UNSERVED_GRACE_S), telemetry.shutdown)
        log.info("stopped")
        return Outcome.ABANDONED
    try:
        engine = loading.result()
    except BaseException as error:
        # A load that failed on the checkpoint or this host is one error line. A ConfigError (e.g. a KV
        # pool the host cannot hold: one line naming the flag, as before listening) and anything else
        # (a bug: its traceback) go on up. Either way the server is stopped first.
        is_failed = isinstance(error, LOAD_FAILURES) and not isinstance(error, ConfigError)
        if is_failed:
            log.error("could not load %s: %s", config.engine.model_dir, error)
            log.debug("the load failed here", exc_info=True)
        await _in_turn(lambda: running.stop(UNSERVED_GRACE_S), telemetry.shutdown)
        if not is_failed:
            raise
        return Outcome.FAILED
    try:
        unserved = await _until_serving(config, engine, servicer, telemetry, stop)
    except BaseException:  # a bug, a cancel: nothing is left held (the engine's thread would hold the exit)
        await _stop_unserved(engine, servicer, running, telemetry)
        raise
    if unserved is not None:
        await _stop_unserved(engine, servicer, running, telemetry)
        return unserved
    servicer.engine = engine  # calls reach the engine from here on: whatever ends it, they are drained
    watchdog: asyncio.Task[None] | None = None
    try:
        freeze_startup_heap()
        await running.set_serving()
        log.info("serving %s on port %d", config.model_name, running.port)
        if ready is not None:
            ready.set()
        # A failed group cannot recover: rank 0 then stops too, so the whole group exits non-zero.
        watchdog = asyncio.create_task(_watch_engine(engine, running, stop if rank is not None else None))
        await stop.wait()
        healthy = engine.is_healthy
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await _in_turn(
            lambda: drain(running, engine, config.server.grace_s),
            engine.shutdown,
            thaw_startup_heap,
            lambda: _close_encoder_parts(servicer),
            telemetry.shutdown,  # flushes spans and metrics still buffered
        )
    log.info("stopped")
    return Outcome.STOPPED if healthy else Outcome.FAILED


async def _until_serving(
    config: DecoderConfig,
    engine: Engine,
    servicer: DecoderServicer,
    telemetry: Telemetry,
    stop: asyncio.Event,
) -> Outcome | None:
    """From a loaded engine to where it may serve: GetModelInfo's samples of the checkpoint read, and
    the --encoder's model checked. None once it may serve; else how a decoder that never served ends
    (the caller releases what it holds, as on any error raised here)."""
    # This thread only converts requests (small tensor ops): one intra-op thread, so it never holds
    # an OpenMP team that would slow the engine thread's steps.
    torch.set_num_threads(1)
    model_dir = Path(config.engine.model_dir)
    try:
        servicer.token_table_sample = checkpoint_sample(model_dir)  # 16 rows read
        servicer.weight_samples = checkpoint_weight_samples(model_dir)  # 16 rows a tensor
    except OSError as error:  # the checkpoint changed since it loaded (a file removed, a disk gone)
        log.error("could not read %s once loaded: %s", model_dir, error)
        log.debug("the read failed here", exc_info=True)
        return Outcome.FAILED
    if config.encoder_address:
        try:
            servicer.encoder_parts = EncoderParts(
                config.encoder_address,
                engine.model_config.dtype,
                config.server.max_message_bytes,
                config.encoder_cache_bytes,
                telemetry,
                model_dir=model_dir,
                model_name=config.model_name,
                hidden_size=engine.model_config.hidden_size,
            )
        except OSError as error:  # its sample of the checkpoint, or the shared memory it maps
            log.error("could not set up the parts --encoder fetches: %s", error)
            log.debug("the set-up failed here", exc_info=True)
            return Outcome.FAILED
    if servicer.encoder_parts is not None:
        log.info("encoder parts are fetched from %s", config.encoder_address)
        checking = asyncio.ensure_future(servicer.encoder_parts.check_model(ENCODER_CHECK_S))
        try:
            is_checked = await _unless_stopped(checking, stop)
        finally:  # not waited for once stopped (the encoder may still be loading), nor past an error
            checking.cancel()
            await asyncio.wait({checking})
        if not is_checked:
            log.info("stopping before the encoder's model was checked")
            return Outcome.STOPPED
        try:
            log.info("%s", checking.result())
        except EncoderMismatch as error:
            log.error("refusing --encoder: %s", error)
            return Outcome.FAILED
    if stop.is_set():  # the signal came as the load ended: stop without serving a moment
        log.info("stopping before serving")
        return Outcome.STOPPED
    return None


async def _unless_stopped(work: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Waits for `work` until `stop` is set; True when `work` is done (it is left running if not)."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    return work.done()


async def _stop_unserved(
    engine: Engine, servicer: DecoderServicer, running: RunningServer, telemetry: Telemetry
) -> None:
    """Closes a loaded engine that never served (no call reached it): nothing to drain."""
    await _in_turn(
        engine.shutdown,
        lambda: _close_encoder_parts(servicer),
        lambda: running.stop(UNSERVED_GRACE_S),
        telemetry.shutdown,
    )
    log.info("stopped")


async def _close_encoder_parts(servicer: DecoderServicer) -> None:
    if servicer.encoder_parts is not None:
        await servicer.encoder_parts.close()


async def _in_turn(*steps: Callable[[], Awaitable[object] | None]) -> None:
    """Takes each of `steps` (a call, or a call whose awaitable is awaited) in turn, whatever an earlier
    one raised: one release that fails must not leave the next thing held (an engine thread that the
    interpreter's exit joins, a port still bound, spans never flushed). An error is raised once all
    were taken: the last, any earlier one its __context__, as nested `finally` blocks give, and one
    already in flight where this is called (a failed load, a cancel) the first of them. Nested
    `finally` blocks, not an AsyncExitStack: the stack ended a failed release's __context__ chain at
    it, so a drain and a telemetry shutdown that both failed showed the telemetry's error alone."""
    first, *rest = steps
    try:
        await _take(first)
    finally:
        if rest:
            await _in_turn(*rest)


async def _take(step: Callable[[], Awaitable[object] | None]) -> None:
    taken = step()
    if taken is not None:
        await taken


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
