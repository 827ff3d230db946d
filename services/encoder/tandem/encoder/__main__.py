"""`tandem serve encoder` / `python -m tandem.encoder`: serve one embedder until SIGTERM or SIGINT.

Every flag can also come from a `TANDEM_ENCODER_<FLAG>` variable (`options.py`, on the one
configuration layer in `tandem.common.flags`), read when the command runs, never at import time. The
model and the port are checked first; then the server listens with health NOT_SERVING and turns
SERVING once the embedder has loaded, so orchestrators can tell "starting" from "dead".
Exit codes: 0 after a signal, 1 when the embedder cannot be loaded though every file it reads checked
out, 2 for a flag or variable that is wrong (a port in use included) or a file the load would refuse,
found from configs and safetensors headers before the port opens as the decoder finds its own, naming
its flag: --model's config.json, token table (a header that does not parse, or a shape not the one
config.json says) or tokenizer.json (missing, not one the tokenizers library reads, or of more tokens
than its vocab_size), --adapter's adapter_config.json and prompt rows, --encoder-model's config.json,
--projector's layout and widths, or any of them missing or not a directory or file as it must be;
every failure is one line. `tandem up` runs the same checks (`check_start`) before it starts any
service.

Stopping (SIGTERM or SIGINT): health NOT_SERVING, no new calls, and calls in flight get --grace-s to
finish. Any still queued or in a batch then end UNAVAILABLE ("the encoder is shutting down"), and the
batch on the worker thread skips the images it has not prepared, so the process exits within the
grace period plus the step the worker is in (one image's decoding and preprocessing, or one tower
pass), not after every batch in flight has run. A signal while the embedder still loads ends the
process at once (exit 0), the load abandoned rather than waited for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
from tokenizers import Tokenizer

from tandem.client.errors import ConfigError
from tandem.client.telemetry import setup_telemetry
from tandem.common import replica_name
from tandem.common.checkpoint import read_json
from tandem.common.flags import CONTEXT_SETTINGS, flag_error, run
from tandem.common.listening import check_port_free
from tandem.common.running_server import RunningServer, notice_within
from tandem.common.server import start_server
from tandem.common.startup_heap import freeze_startup_heap, thaw_startup_heap
from tandem.common.stop_signals import stop_on_signals
from tandem.common.torch_part.model_cache import resolve_model
from tandem.common.vision_language import is_vision_language, text_config
from tandem.encoder.config import EncoderConfig
from tandem.encoder.embedder import EmbedderLoadError
from tandem.encoder.loader import check_architecture, load_embedder
from tandem.encoder.lookup import (
    check_table_shape,
    check_tokenizer_fits,
    read_model_shape,
    read_tokenizer,
)
from tandem.encoder.options import config_from_options, settings
from tandem.encoder.projector import check_projector, encoder_hidden_size
from tandem.encoder.servicer import EncoderServicer
from tandem.encoder.soft_prompt import check_prompt

log = logging.getLogger("tandem.encoder")
T = TypeVar("T")

PROG = "tandem serve encoder"
# The embedders that serve rows of --model's own token table (the projector reads only its shape).
TABLE_EMBEDDERS = ("lookup", "soft-prompt")
# After the grace period: how long calls ended UNAVAILABLE get to say so before gRPC cancels them. The
# server stops as soon as none is left, so this is only ever waited out by a handler that cannot run:
# 1 s was too little once, for one of 32 ended calls, with the whole test suite on 2 cores (it got
# gRPC's GOAWAY instead of the reason).
CUT_S = 3.0


def command() -> click.Command:
    return click.Command(
        "encoder",
        params=settings(),
        callback=_start,
        help="Serve tandem.v1.Encoder: text or token IDs in, embeddings in a decoder's hidden space out.",
        context_settings=CONTEXT_SETTINGS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run(command(), argv, PROG)


def config_from_args(argv: Sequence[str]) -> EncoderConfig:
    """The config `tandem serve encoder ARGV` runs: flags, then TANDEM_ENCODER_* variables, then
    defaults. Raises click.UsageError for a value that does not parse, ConfigError for one refused."""
    with command().make_context(PROG, list(argv)) as ctx:
        return config_from_options(ctx.params)


def _start(**values: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = click.get_current_context()
    try:
        config = config_from_options(values)
        check_port_free(config.server.host, config.server.port)
        # A GGUF file is imported once, before the port opens: a bad file is one line.
        try:
            model_dir = resolve_model(config.model_dir, config.dtype, say=log.info)
        except ValueError as error:  # ModelNotFound, GGUFImportError
            raise ConfigError("model_dir", f": {error}") from None
        config = dataclasses.replace(config, model_dir=model_dir)
        tokenizer = check_start(config)
    except ConfigError as error:
        raise flag_error(ctx.command, error) from None
    try:
        loaded = asyncio.run(serve(config, tokenizer))
    except ConfigError as error:  # the port, taken since it was checked
        raise flag_error(ctx.command, error) from None
    except (EmbedderLoadError, OSError) as error:
        log.error("could not load the %s embedder: %s", config.embedder, error)
        return 1
    if not loaded:
        _exit_leaving_the_load()
    return 0


def _exit_leaving_the_load() -> NoReturn:
    """Exit 0 now, with the embedder still loading. Its thread cannot be interrupted (it is inside
    safetensors, torch or a tokenizer) and the interpreter's exit would join it, so a signal during a
    load of minutes would take minutes to act on. Everything else is closed by now: the server, the
    shared-memory pool, the telemetry."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_start(config: EncoderConfig) -> Tokenizer | None:
    """What the encoder refuses of `config` (its --model resolved to a checkpoint directory) before it
    listens, beyond its flags' own checks: the paths its embedder reads and what the load would refuse
    of each (as the decoder checks its checkpoint: configs and safetensors headers, no weight read),
    room in --max-message-bytes for an image's reply, and tokenizer.json. `tandem up` runs it too, so
    that it refuses before starting anything: it ran only the flags' checks, and both services started.
    Returns the tokenizer it parsed, for the load to take (None where the embedder reads none of
    --model's). Raises ConfigError naming the flag of the file at fault."""
    config.check_embedder_paths()
    takes_images = _takes_images(config.model_dir)
    if takes_images:  # a flag's check: before the files'
        config.check_room_for_images()
    if config.embedder == "lookup":  # the embedder that serves a checkpoint's images
        _refused_as("model_dir", check_architecture, config.model_dir)
    tokenizer = None
    if config.embedder in TABLE_EMBEDDERS:
        _refused_as("model_dir", check_table_shape, config.model_dir)
        tokenizer = _check_tokenizer(config.model_dir, takes_images)
    if config.embedder == "soft-prompt":  # the load reads the adapter after --model's table
        assert config.adapter_dir is not None  # guaranteed by EncoderConfig's validation
        hidden_size = _refused_as("model_dir", read_model_shape, config.model_dir).hidden_size
        _refused_as("adapter_dir", check_prompt, config.adapter_dir, hidden_size)
    if config.embedder == "projector":
        _check_projector(config)
    return tokenizer


def _refused_as(field: str, check: Callable[..., T], *args: Any) -> T:
    """`check(*args)`, its EmbedderLoadError a ConfigError naming `field`'s flag: what the load found
    only after the server listened (one ERROR line, --adapter or --projector not named, exit 1)."""
    try:
        return check(*args)
    except EmbedderLoadError as error:
        raise ConfigError(field, f": {error}") from None


def _check_projector(config: EncoderConfig) -> None:
    """--model's hidden size, --encoder-model's config.json, and --projector's header mapping the one
    to the other, as the projector embedder's load checks them, without importing transformers."""
    assert config.encoder_model_dir is not None and config.projector_path is not None
    decoder_hidden = _refused_as("model_dir", read_model_shape, config.model_dir).hidden_size
    encoder_hidden = _refused_as("encoder_model_dir", encoder_hidden_size, config.encoder_model_dir)
    _refused_as(
        "projector_path",
        check_projector,
        config.projector_path,
        encoder_hidden,
        decoder_hidden,
        config.model_dir,
    )


def _check_tokenizer(model_dir: Path, takes_images: bool) -> Tokenizer:
    """--model's tokenizer.json, which the table's embedders (and a vision-language checkpoint's) read,
    is there, parses, holds no more tokens than the table's rows (a vision-language checkpoint's
    text_config's vocab_size) and a vision-language checkpoint's image placeholder: each was refused
    only by the load, after the server listened (exit 1), the vision-language count by nothing.
    Returns it for the load, which then parses no file of 3.5 MB (SmolLM2's) a second time: 65-290 ms
    measured. Raises ConfigError naming the file."""
    try:
        tokenizer = read_tokenizer(model_dir)
        _check_tokenizer_fits(model_dir, tokenizer, takes_images)
        if takes_images:
            from tandem.encoder.vision.placeholder import image_placeholder

            image_placeholder(model_dir, read_json(model_dir / "config.json", EmbedderLoadError), tokenizer)
    except EmbedderLoadError as error:
        raise ConfigError("model_dir", f": {error}") from None
    return tokenizer


def _check_tokenizer_fits(model_dir: Path, tokenizer: Tokenizer, takes_images: bool) -> None:
    """Against config.json's vocab_size, or a vision-language checkpoint's text_config's (its language
    model's table, where an outer vocab_size of an older LLaVA config sizes nothing). check_table_shape
    has run: config.json reads, and that vocab_size is an integer."""
    if takes_images:
        hf_config = read_json(model_dir / "config.json", EmbedderLoadError)
        vocab_size = text_config(hf_config, EmbedderLoadError)["vocab_size"]
    else:
        vocab_size = read_model_shape(model_dir).vocab_size
    check_tokenizer_fits(tokenizer, vocab_size, model_dir, is_vision_language=takes_images)


def _takes_images(model_dir: Path) -> bool:
    """Whether the checkpoint is a vision-language one, from its config.json alone (a file that cannot
    be read is the load's to report, in its own words)."""
    try:
        return is_vision_language(read_json(model_dir / "config.json", ValueError))
    except (ValueError, OSError, LookupError, TypeError):  # unreadable, or `architectures` no list
        return False


async def serve(config: EncoderConfig, tokenizer: Tokenizer | None = None) -> bool:
    """Listen, load the embedder off the loop, serve until a signal, then drain and stop. `tokenizer`:
    --model's, parsed by `check_start`, for the load to take rather than parse again.

    False when a signal came before the embedder had loaded: all is closed but the thread loading it,
    which is left to finish (or to the process's end) rather than waited for."""
    telemetry = setup_telemetry("tandem-encoder", os.environ)  # OTEL_*; off when nothing is configured
    servicer = EncoderServicer(config, telemetry=telemetry)
    interceptors = (*config.server.interceptors, *telemetry.server_interceptors())
    running = await start_server(
        dataclasses.replace(config.server, interceptors=interceptors),
        [servicer.service()],
    )
    servicer.replica = replica_name.own_name(config.server.host, running.port)
    stop_requested = stop_on_signals(config.server.grace_s, log)
    loading = asyncio.ensure_future(servicer.on_worker(load_embedder, config, tokenizer))
    stopping = asyncio.ensure_future(stop_requested.wait())
    try:
        log.info("loading the %s embedder for %s", config.embedder, config.model_dir)
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            embedder = loading.result()  # re-raises a load error
            if embedder.info.image_placeholder:  # a vision-language checkpoint: name its image half
                log.info("images: %s", embedder.describe())  # type: ignore[attr-defined]
            servicer.attach(embedder)
            freeze_startup_heap()
            await running.set_serving()
            log.info("serving %s on port %d", config.served_model_name, running.port)
            await stopping
        else:
            log.info("stopping before the embedder finished loading")
    finally:
        loaded = loading.done()
        loading.cancel()
        stopping.cancel()
        await drain(running, servicer, config.server.grace_s)
        servicer.close(wait=loaded)
        thaw_startup_heap()
        telemetry.shutdown()  # flushes spans and metrics still buffered
        log.info("stopped")
    return loaded


async def drain(running: RunningServer, servicer: EncoderServicer, grace_s: float) -> None:
    """No new calls; calls in flight get `grace_s` to finish, then end UNAVAILABLE.

    gRPC itself would cancel what is left at its deadline, leaving each cancelled call's handler to log
    a CancelledError traceback, so its deadline is CUT_S later: by then every call ended here has sent
    its status, and the server stops as soon as none is left.
    """
    # The notice within `grace_s`, not its cut: a call taken after end_calls would be refused.
    stopping = asyncio.ensure_future(running.stop(grace_s + CUT_S, notice_s=notice_within(grace_s)))
    done, _ = await asyncio.wait({stopping}, timeout=grace_s)
    if not done:
        num_ended = servicer.end_calls()
        log.info("grace period over: %d calls in flight end UNAVAILABLE", num_ended)
    await stopping


if __name__ == "__main__":
    raise SystemExit(main())
