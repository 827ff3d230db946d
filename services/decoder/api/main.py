"""`tandem serve decoder` / `python -m services.decoder`: load the model, serve until SIGTERM.

Every flag can also come from a `TANDEM_<FLAG>` environment variable (e.g. TANDEM_MAX_NUM_SEQS);
a flag on the command line wins. The environment is read here, at start, never at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from common.auth import load_tokens
from common.dtypes import DTYPES
from common.pb.tandem.v1 import decoder_pb2_grpc
from common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, Service, TlsOptions, start_server
from common.telemetry import setup_telemetry
from services.decoder.api.servicer import DecoderServicer
from services.decoder.backends.backend import BackendUnavailable, check_available, resolve
from services.decoder.config import DecoderConfig, EngineConfig
from services.decoder.distributed.parallel import RankInfo, init_parallel
from services.decoder.distributed.worker import (
    join_local_ranks,
    rank_config,
    rank_info,
    run_worker,
    spawn_local_ranks,
)
from services.decoder.engine.engine import Engine
from services.decoder.models.default_model import default_model_dir

log = logging.getLogger("tandem.decoder")


def _flag_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem serve decoder", description="Serve tandem.v1.Decoder over gRPC.")
    p.add_argument(
        "--model", type=Path, help="Hugging Face model directory (default: the embedded tiny model)"
    )
    p.add_argument("--model-name", default="", help="name reported to clients (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or neuron (neuron needs torch-neuronx)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: the device's (bfloat16)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=512 * 1024 * 1024, help="KV pool size in bytes")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides bytes)")
    p.add_argument("--enable-prefix-caching", type=_flag_bool, default=True)
    p.add_argument("--native-kernels", type=_flag_bool, default=True)
    p.add_argument("--enable-prompt-embeds", type=_flag_bool, default=True)
    p.add_argument(
        "--static-shapes", type=_flag_bool, default=None, help="default: true on neuron, else false"
    )
    p.add_argument(
        "--compile",
        type=_flag_bool,
        default=None,
        help="static shapes: compile each decode bucket at warmup (default: true on neuron, else false)",
    )
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--grace-s", type=float, default=10.0, help="drain time for in-flight streams on SIGTERM")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks to shard the model over (spawned here unless torchrun)",
    )
    p.add_argument(
        "--collective-timeout-s", type=float, default=60.0, help="several ranks: collective timeout"
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="TLS: server certificate chain (PEM)")
    p.add_argument("--tls-key", type=Path, default=None, help="TLS: server private key (PEM)")
    p.add_argument(
        "--tls-client-ca", type=Path, default=None, help="mutual TLS: CA that must sign client certificates"
    )
    p.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="accepted bearer tokens, one per line; every call but health then needs one",
    )
    return p


def _with_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        env_name = "TANDEM_" + action.dest.upper()
        if env_name in environ:
            raw = environ[env_name]
            action.default = action.type(raw) if action.type else raw


def config_from_args(argv: Sequence[str] | None, environ: dict[str, str] | None = None) -> DecoderConfig:
    parser = build_parser()
    _with_env_defaults(parser, dict(os.environ if environ is None else environ))
    args = parser.parse_args(argv)
    model_dir = args.model or default_model_dir()
    backend = resolve(args.device)  # ValueError on an unknown device; imports no SDK
    engine = EngineConfig(
        model_dir=model_dir,
        dtype=args.dtype or backend.default_dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        native_kernels=args.native_kernels,
        enable_prompt_embeds=args.enable_prompt_embeds,
        static_shapes=backend.requires_static_shapes if args.static_shapes is None else args.static_shapes,
        compile=backend.requires_static_shapes if args.compile is None else args.compile,
        num_threads=args.num_threads,
    )
    server = ServerOptions(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        grace_s=args.grace_s,
        tls=TlsOptions.from_paths(args.tls_cert, args.tls_key, args.tls_client_ca),
        auth_tokens=load_tokens(args.auth_token_file) if args.auth_token_file is not None else frozenset(),
    )
    return DecoderConfig(
        engine=engine,
        server=server,
        model_name=args.model_name or Path(model_dir).name,
        world_size=args.world_size,
        collective_timeout_s=args.collective_timeout_s,
    )


def ensure_default_model(model_dir: Path) -> None:
    """Create the embedded default model on first use, so `--model` is optional."""
    if model_dir == default_model_dir() and not (model_dir / "config.json").exists():
        from services.decoder.models.default_model import make_model

        log.info("creating the embedded default model in %s", model_dir)
        make_model(model_dir)


async def serve(
    config: DecoderConfig, ready: asyncio.Event | None = None, rank: RankInfo | None = None
) -> bool:
    """Serves until SIGTERM; with `rank` (several ranks) also until the group fails. False on failure."""
    telemetry = setup_telemetry("tandem-decoder", os.environ)  # OTEL_*; off when nothing is configured
    servicer = DecoderServicer(
        config.model_name, config.server.max_message_bytes, config.world_size, telemetry=telemetry
    )
    interceptors = (*config.server.interceptors, *telemetry.server_interceptors())
    running = await start_server(
        dataclasses.replace(config.server, interceptors=interceptors),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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
    ensure_default_model(Path(config.engine.model_dir))
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
    except (ValueError, BackendUnavailable) as exc:
        print(f"tandem serve decoder: {exc}", file=sys.stderr)
        return 2
    if rank is None:
        asyncio.run(serve(config))
        return 0
    config = rank_config(config, rank)
    if rank.rank != 0:
        return run_worker(rank, config)
    ensure_default_model(Path(config.engine.model_dir))  # before the other ranks look for it
    workers = [] if rank.is_torchrun else spawn_local_ranks(config, rank)
    healthy = asyncio.run(serve(config, rank=rank))
    healthy = join_local_ranks(workers, config.collective_timeout_s) and healthy
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
