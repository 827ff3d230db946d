"""`python -m services.encoder`: serve one embedder over gRPC until SIGTERM or SIGINT.

Every flag can also come from a `TANDEM_ENCODER_<FLAG>` environment variable (e.g. `--max-input-tokens`
from TANDEM_ENCODER_MAX_INPUT_TOKENS), read in `main` when the flag is not given, never at import
time. The server listens first, with health NOT_SERVING, and turns SERVING once the embedder has
loaded, so orchestrators can tell "starting" from "dead". Exit codes: 0 after a signal, 1 when the
embedder cannot be loaded or the port bound, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.auth import load_tokens
from common.dtypes import DTYPES
from common.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from common.server import ServerOptions, Service, TlsOptions, install_signal_handlers, start_server
from common.telemetry import setup_telemetry
from services.encoder.config import DEFAULT_PORT, EMBEDDERS, EncoderConfig
from services.encoder.embedder import EmbedderLoadError, Pooling
from services.encoder.loader import load_embedder
from services.encoder.servicer import EncoderServicer

log = logging.getLogger("services.encoder")

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name  # "tandem.v1.Encoder"
ENV_PREFIX = "TANDEM_ENCODER_"
# Flag dest -> how its string value (flag or environment variable) is parsed.
_TYPES: dict[str, Callable[[str], Any]] = {
    "model": Path,
    "embedder": str,
    "adapter": Path,
    "encoder_model": Path,
    "projector": Path,
    "pooling": Pooling,
    "dtype": str,
    "max_input_tokens": int,
    "model_name": str,
    "host": str,
    "port": int,
    "max_message_bytes": int,
    "grace_s": float,
    "tls_cert": Path,
    "tls_key": Path,
    "tls_client_ca": Path,
    "auth_token_file": Path,
}
_SECURITY = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")  # become ServerOptions fields


def env_var(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def build_parser(prog: str = "python -m services.encoder") -> argparse.ArgumentParser:
    """Every flag defaults to None so that `config_from_args` can tell "not given" apart."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve tandem.v1.Encoder: text or token IDs -> embeddings in a decoder's hidden space.",
        epilog=f"Each flag may instead be set by {ENV_PREFIX}<FLAG>, e.g. {env_var('max_input_tokens')}.",
    )

    def add(flag: str, description: str, **kwargs: Any) -> None:
        dest = flag.removeprefix("--").replace("-", "_")
        parser.add_argument(flag, type=_TYPES[dest], help=f"{description} [{env_var(dest)}]", **kwargs)

    add("--model", "decoder checkpoint directory (required)", metavar="DIR")
    add("--embedder", "embedder kind (default lookup)", choices=EMBEDDERS)
    add("--adapter", "soft-prompt: PEFT prompt-tuning adapter directory", metavar="DIR")
    add("--encoder-model", "projector: Hugging Face encoder model directory", metavar="DIR")
    add("--projector", "projector: safetensors projector weights", metavar="FILE")
    add("--pooling", "pooling when a request leaves it unspecified (default none)", choices=list(Pooling))
    add("--dtype", "native dtype of the embeddings (default bfloat16)", choices=list(DTYPES))
    add("--max-input-tokens", "most positions per Embed call (default 8192)", metavar="N")
    add("--model-name", "name reported and checked (default: the model directory's name)")
    add("--host", "listen address (default 127.0.0.1; 0.0.0.0 in containers)")
    add("--port", f"listen port (default {DEFAULT_PORT}; 0 = any free port)")
    add("--max-message-bytes", "largest gRPC message sent or received", metavar="N")
    add("--grace-s", "seconds in-flight RPCs get to finish on shutdown", metavar="S")
    add("--tls-cert", "TLS: server certificate chain (PEM)", metavar="FILE")
    add("--tls-key", "TLS: server private key (PEM)", metavar="FILE")
    add("--tls-client-ca", "mutual TLS: CA that must sign client certificates", metavar="FILE")
    add("--auth-token-file", "accepted bearer tokens, one per line (health stays open)", metavar="FILE")
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EncoderConfig:
    """Flags first, then TANDEM_ENCODER_* variables, then the config's defaults. Raises ValueError."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for dest, parse in _TYPES.items():
        value = getattr(args, dest, None)
        raw = environ.get(env_var(dest))
        if value is None and raw:
            try:
                value = parse(raw)
            except ValueError as e:
                raise ValueError(f"{env_var(dest)}={raw!r}: {e}") from None
        if value is not None:
            values[dest] = value
    if "model" not in values:
        raise ValueError(f"--model DIR is required (or set {env_var('model')})")
    server = {k: values[k] for k in ("host", "port", "max_message_bytes", "grace_s") if k in values}
    security = {k: values.pop(k, None) for k in _SECURITY}
    server["tls"] = TlsOptions.from_paths(
        security["tls_cert"], security["tls_key"], security["tls_client_ca"]
    )
    if security["auth_token_file"] is not None:
        server["auth_tokens"] = load_tokens(security["auth_token_file"])
    renamed = {"adapter": "adapter_dir", "encoder_model": "encoder_model_dir", "projector": "projector_path"}
    fields = {renamed.get(k, k): v for k, v in values.items() if k not in server}
    return EncoderConfig(
        model_dir=fields.pop("model"), server=ServerOptions(**{"port": DEFAULT_PORT, **server}), **fields
    )


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
    try:
        asyncio.run(serve(config))
    except (EmbedderLoadError, OSError) as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
