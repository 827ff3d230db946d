"""What `tandem up` runs for each service and where it then reaches it: the command line (the same
`tandem serve <service> FLAGS` the container image runs), the environment, the address a probe asks."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from tandem.common.listening import listen_host
from tandem.common.torch_part.quantized_tensor import SCHEMES
from tandem.up_config import SECURITY_FIELDS, UpConfig


def serve_command(service: str, config: UpConfig) -> list[str]:
    """`serve <service> FLAGS`: what follows `tandem` here and in docker-compose.yml's `command`."""
    if service == "openai":
        return gateway_command(config)
    port = {"encoder": config.encoder_port, "decoder": config.decoder_port}[service]
    argv = ["serve", service]
    if config.model_dir is not None:
        argv += ["--model", str(config.model_dir)]
    argv += ["--host", config.host, "--port", str(port)]
    if config.dtype is not None:
        argv += ["--dtype", config.dtype]
    if service == "decoder" and config.world_size is not None:
        argv += ["--world-size", str(config.world_size)]
    if service == "decoder" and config.device is not None:
        argv += ["--device", config.device]
    # The encoder rounds its lookup table as the decoder rounds the model's (int8, int4); a GGUF
    # file's own weights need nothing of it: the imported table holds the file's values.
    if config.quantization != "none" and (service == "decoder" or config.quantization in SCHEMES):
        argv += ["--quantization", config.quantization]
    if service == "decoder" and config.quantization_group_size is not None:
        argv += ["--quantization-group-size", str(config.quantization_group_size)]
    argv += ["--grace-s", f"{config.grace_s:g}"]
    if service == "decoder" and config.tls_cert is None:
        # Encoder parts: the decoder fetches their rows itself, over /dev/shm on this one host. (Its
        # channel to the encoder speaks plaintext: with TLS the decoder takes no encoder parts.)
        argv += ["--encoder", f"{reachable_host(config.host)}:{config.encoder_port}"]
    for name in SECURITY_FIELDS:
        path = getattr(config, name)
        if path is not None:
            argv += ["--" + name.replace("_", "-"), str(path)]
    return argv


def gateway_command(config: UpConfig) -> list[str]:
    """The gateway in front of both services, with their token file (it passes callers' tokens on)."""
    host = reachable_host(config.host)
    argv = ["serve", "openai", "--host", config.host, "--port", str(config.openai_port)]
    argv += [
        "--decoder-address",
        f"{host}:{config.decoder_port}",
        "--encoder-address",
        f"{host}:{config.encoder_port}",
        "--grace-s",
        f"{config.grace_s:g}",
    ]
    if config.auth_token_file is not None:
        argv += ["--auth-token-file", str(config.auth_token_file)]
    return argv


def reachable_host(host: str) -> str:
    """Where a service listening on `host` is reached from this host (an IPv6 address in brackets)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else listen_host(host)


def service_argv(service: str, config: UpConfig) -> list[str]:
    """The child process that runs `service`: `tandem serve <service> FLAGS` in this Python."""
    return [sys.executable, "-m", "tandem.cli", *serve_command(service, config)]


def ready_targets(config: UpConfig) -> dict[str, str]:
    """What each service is, by the target `tandem wait` (and `up` itself) probes it at."""
    host = reachable_host(config.host)
    targets = {
        "the encoder": f"{host}:{config.encoder_port}",
        "the decoder": f"{host}:{config.decoder_port}",
    }
    if config.openai_port is not None:
        targets["the OpenAI API"] = f"http://{host}:{config.openai_port}/health"
    return targets


# The services' own variables for what `up` decides for both (docs/CONFIGURATION.md): the model, its
# dtype, device, ranks and rounding. `up` passes each only when given, and its pre-checks read its own
# values (defaults otherwise): a TANDEM_MODEL or TANDEM_QUANTIZATION left in the environment would have
# the decoder run another model, or round it otherwise, than what was checked and than the encoder.
DECODER_OWNED = ("MODEL", "DTYPE", "DEVICE", "WORLD_SIZE", "QUANTIZATION", "QUANTIZATION_GROUP_SIZE")
ENCODER_OWNED = ("MODEL", "DTYPE", "QUANTIZATION")  # the encoder has no device, ranks or group size
OWNED_VARIABLES = (*(f"TANDEM_{n}" for n in DECODER_OWNED), *(f"TANDEM_ENCODER_{n}" for n in ENCODER_OWNED))


def service_environment() -> dict[str, str]:
    """The environment each service starts with: `up`'s own, less the variables for settings `up`
    decides, output unbuffered for the relays."""
    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def in_service_environment() -> Iterator[None]:
    """os.environ as a service will see it, for parsing its config here (before any thread starts)."""
    saved, service = dict(os.environ), service_environment()
    os.environ.clear()
    os.environ.update(service)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
