"""`tandem up`'s settings: UpConfig, what it refuses of them alone, and the services it starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tandem.client.errors import ConfigError
from tandem.common.server_options import DEFAULT_GRACE_S

SERVICES = ("encoder", "decoder")
# After the grace period: time for the services to end their aborted streams, flush their spans and
# exit, before `up` kills them. Compose's stop_grace_period and Kubernetes' terminationGracePeriodSeconds
# are --grace-s plus this too (tests check both).
STOP_MARGIN_S = 15.0
SECURITY_FIELDS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")


@dataclass(frozen=True)
class UpConfig:
    model_dir: Path | None  # checkpoint directory or .gguf file for both; None = the default model
    host: str  # listen address of both services
    encoder_port: int
    decoder_port: int
    dtype: str | None  # passed to both; None leaves each service its own default
    world_size: int | None  # decoder ranks (neuron: devices); None leaves the decoder its default
    device: str | None = None  # the decoder's --device (the encoder stays on the CPU); None: its default
    quantization: str = "none"  # the decoder's --quantization (and the encoder's, for int8 / int4)
    quantization_group_size: int | None = None  # int4: the decoder's; None leaves its default
    grace_s: float = DEFAULT_GRACE_S  # both services' drain time; `up` kills STOP_MARGIN_S after it
    tls_cert: Path | None = None  # both services: TLS server certificate (PEM); None = plaintext
    tls_key: Path | None = None  # both services: its private key
    tls_client_ca: Path | None = None  # both services: mutual TLS, the CA client certificates need
    auth_token_file: Path | None = None  # both services: accepted bearer tokens, one per line
    openai_port: int | None = None  # the OpenAI HTTP gateway's port; None: no gateway

    def __post_init__(self) -> None:
        for name in ("encoder_port", "decoder_port"):
            if not 0 < getattr(self, name) <= 65535:
                raise ConfigError(name, f"must be in 1..65535, got {getattr(self, name)}")
        if self.openai_port is not None and not 0 < self.openai_port <= 65535:
            raise ConfigError("openai_port", f"must be in 1..65535, got {self.openai_port}")
        if self.openai_port in (self.encoder_port, self.decoder_port):
            raise ConfigError("openai_port", f"must differ from the services' ports, got {self.openai_port}")
        if self.openai_port is not None and self.tls_cert is not None:
            raise ConfigError(
                "openai_port",
                ": the gateway under `up` reaches the services in plaintext; with TLS, start "
                "`tandem serve openai --upstream-tls-ca ...` yourself",
            )
        if self.encoder_port == self.decoder_port:
            raise ConfigError(
                "decoder_port", f"must differ from --encoder-port, both are {self.decoder_port}"
            )
        # NaN passed `< 0`: the services refused it only once started, and `up` then killed them at once.
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ConfigError("grace_s", f"must be a finite number of seconds, 0 or more, got {self.grace_s}")

    @property
    def kill_after_s(self) -> float:
        return self.grace_s + STOP_MARGIN_S


def services(config: UpConfig) -> tuple[str, ...]:
    return (*SERVICES, "openai") if config.openai_port is not None else SERVICES
