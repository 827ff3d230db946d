"""The OpenAI gateway's configuration: one frozen object, validated when built, passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.client.channel import PLAINTEXT, ChannelSecurity
from tandem.client.errors import ConfigError

DEFAULT_PORT = 8000  # vLLM's and SGLang's OpenAI port


@dataclass(frozen=True)
class GatewayConfig:
    decoder_address: str = "127.0.0.1:50052"  # host:port, several, or dns:/// (balanced, as the client)
    encoder_address: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # Accepted bearer tokens (the services' token file); None: no authentication. A caller's token is
    # passed on to the services with each call, so their per-token limits and fair sharing see it.
    auth_tokens: frozenset[str] | None = None
    upstream: ChannelSecurity = field(default=PLAINTEXT)  # TLS and token towards the services
    # A request body's bytes (a prompt of embedding rows travels as base64: 4/3 of its bytes).
    max_body_bytes: int = 96 * 1024 * 1024
    # Open completions per caller (its bearer token with tokens on, else its IP address); 429 beyond it.
    # HTTP/1.1 carries one request a connection, so a connection bound would bound nothing.
    max_streams_per_caller: int = 32
    max_message_bytes: int = 64 * 1024 * 1024  # the services' --max-message-bytes

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        for name in ("max_body_bytes", "max_streams_per_caller", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
