"""`tandem serve decoder` / `python -m tandem.decoder`: load the model, serve until SIGTERM.

Start-up, in order, each failure one line and an exit code (2: a flag or variable is wrong, a port
in use included; 1: the weights could not be loaded, or --encoder serves another model): the flags
and `TANDEM_*` variables (`options.py`), the device, the port, the model (a GGUF file is imported
once), the checkpoint's files and whether the world size shards it (`start_checks.py`). Only then
does the server listen, health NOT_SERVING while the weights load (`serving.py`), on rank 0 of the
ranks this process runs (`rank_group.py`, which exits by how serving ended); `drain.py` ends its
streams when it stops.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import click

from tandem.client.errors import ConfigError
from tandem.common.flags import CONTEXT_SETTINGS, FlagError, flag_error, run
from tandem.decoder.api.options import config_from_options, settings
from tandem.decoder.api.rank_group import serve_ranks
from tandem.decoder.api.start_checks import checked_config
from tandem.decoder.backends.backend import BackendUnavailable
from tandem.decoder.config import DecoderConfig

PROG = "tandem serve decoder"


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
        config, rank = checked_config(values)
    except ConfigError as error:
        raise flag_error(ctx.command, error) from None
    except BackendUnavailable as error:  # e.g. --device neuron without torch-neuronx: what to install
        raise FlagError(str(error)) from None
    try:
        return serve_ranks(config, rank)
    except ConfigError as error:  # the port, taken since it was checked
        raise flag_error(ctx.command, error) from None
