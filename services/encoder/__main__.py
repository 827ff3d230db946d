"""`python -m services.encoder`: serve one embedder over gRPC until SIGTERM or SIGINT.

Every flag can also come from a `TANDEM_ENCODER_<FLAG>` environment variable (e.g. `--max-input-tokens`
from TANDEM_ENCODER_MAX_INPUT_TOKENS), read in `main` when the flag is not given (`common/flags.py`,
shared with the decoder), never at import time. The server listens first, with health NOT_SERVING,
and turns SERVING once the embedder has loaded, so orchestrators can tell "starting" from "dead".
Exit codes: 0 after a signal, 1 when the embedder cannot be loaded or the port bound, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.dtypes import DTYPES
from common.flags import SERVER_SECURITY, ServiceArgumentParser, server_security
from common.model_cache import default_model_file, model_display_name, resolve_model
from common.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from common.server import ServerOptions, Service, install_signal_handlers, start_server
from common.telemetry import setup_telemetry
from services.encoder.config import DEFAULT_PORT, EMBEDDERS, EncoderConfig
from services.encoder.embedder import EmbedderLoadError, Pooling
from services.encoder.loader import load_embedder
from services.encoder.servicer import EncoderServicer

log = logging.getLogger("services.encoder")

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name  # "tandem.v1.Encoder"
ENV_PREFIX = "TANDEM_ENCODER_"
_SERVER_FLAGS = ("host", "port", "max_message_bytes", "grace_s")  # become ServerOptions fields
# Flag dest -> EncoderConfig field, where they differ.
_RENAMED = {
    "model": "model_dir",
    "adapter": "adapter_dir",
    "encoder_model": "encoder_model_dir",
    "projector": "projector_path",
}


def build_parser(prog: str = "python -m services.encoder") -> ServiceArgumentParser:
    """Every flag defaults to None so that `config_from_args` can tell "not given" apart."""
    parser = ServiceArgumentParser(
        ENV_PREFIX,
        prog=prog,
        description="Serve tandem.v1.Encoder: text or token IDs -> embeddings in a decoder's hidden space.",
    )
    add = parser.add_flag
    add(
        "--model",
        "decoder checkpoint directory or .gguf file (default: the decoder's default, SmolLM2-135M-Instruct)",
        Path,
        metavar="PATH",
    )
    add("--embedder", "embedder kind (default lookup)", choices=EMBEDDERS)
    add("--adapter", "soft-prompt: PEFT prompt-tuning adapter directory", Path, metavar="DIR")
    add("--encoder-model", "projector: Hugging Face encoder model directory", Path, metavar="DIR")
    add("--projector", "projector: safetensors projector weights", Path, metavar="FILE")
    add(
        "--pooling",
        "pooling when a request leaves it unspecified (default none)",
        Pooling,
        choices=list(Pooling),
    )
    add("--dtype", "native dtype of the embeddings (default bfloat16)", choices=list(DTYPES))
    add("--max-input-tokens", "most positions per Embed call (default 8192)", int, metavar="N")
    add("--model-name", "name reported and checked (default: the model directory's or file's name)")
    add("--host", "listen address (default 127.0.0.1; 0.0.0.0 in containers)")
    add("--port", f"listen port (default {DEFAULT_PORT}; 0 = any free port)", int)
    add("--max-message-bytes", "largest gRPC message sent or received", int, metavar="N")
    add("--grace-s", "seconds in-flight RPCs get to finish on shutdown", float, metavar="S")
    parser.add_server_security_flags()
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EncoderConfig:
    """Flags first, then TANDEM_ENCODER_* variables, then the config's defaults. Raises ValueError."""
    parser = build_parser()
    values = parser.values(args, os.environ if environ is None else environ)
    if "model" not in values:
        values["model"] = default_model_file()  # the decoder's default: same table and tokenizer
    values.setdefault("model_name", model_display_name(values["model"]))
    server = {"port": DEFAULT_PORT, **{k: values.pop(k) for k in _SERVER_FLAGS if k in values}}
    server.update(server_security(values))
    for spec in SERVER_SECURITY:
        values.pop(spec.dest, None)
    fields = {_RENAMED.get(k, k): v for k, v in values.items()}
    return EncoderConfig(server=ServerOptions(**server), **fields)


async def serve(config: EncoderConfig) -> None:
    """Listen, load the embedder off the loop, serve until a signal, then drain and stop."""
    telemetry = setup_telemetry("tandem-encoder", os.environ)  # OTEL_*; off when nothing is configured
    servicer = EncoderServicer(config, telemetry=telemetry)
    interceptors = (*config.server.interceptors, *telemetry.server_interceptors())
    running = await start_server(
        dataclasses.replace(config.server, interceptors=interceptors),
        [Service(SERVICE_NAME, servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    stop_requested = asyncio.Event()

    def request_stop(sig: signal.Signals) -> None:
        log.info("received %s: draining for up to %.1f s", sig.name, config.server.grace_s)
        stop_requested.set()

    install_signal_handlers(request_stop)
    loading = asyncio.ensure_future(asyncio.to_thread(load_embedder, config))
    stopping = asyncio.ensure_future(stop_requested.wait())
    try:
        log.info("loading the %s embedder for %s", config.embedder, config.model_dir)
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            servicer.attach(loading.result())  # re-raises a load error
            await running.set_serving()
            log.info("serving %s on port %d", config.served_model_name, running.port)
            await stopping
        else:
            log.info("stopping before the embedder finished loading")
    finally:
        loading.cancel()
        stopping.cancel()
        await running.stop(config.server.grace_s)
        servicer.close()
        telemetry.shutdown()  # flushes spans and metrics still buffered


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))  # exits 2 with the usage line
    try:  # a GGUF file is imported once, before the port opens: a bad file is one line, exit 2
        config = dataclasses.replace(
            config, model_dir=resolve_model(config.model_dir, config.dtype, say=log.info)
        )
    except ValueError as e:
        print(f"tandem serve encoder: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (EmbedderLoadError, OSError) as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
