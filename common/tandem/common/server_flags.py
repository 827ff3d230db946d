"""What both services' commands share: how they listen, drain, and secure their port, as `Setting`s of
a service's prefix, and the ServerOptions their values make."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.client.auth import load_tokens
from tandem.client.errors import ConfigError
from tandem.common.flags import PATH, Setting, default_of
from tandem.common.server_options import DEFAULT_GRACE_S, ServerOptions
from tandem.common.server_tls import TlsOptions


def server_settings(prefix: str, default_port: int) -> list[Setting]:
    """--host, --port, --max-message-bytes, --grace-s and the TLS / token files, as `prefix` variables."""
    return [
        Setting(
            prefix,
            "--host",
            "listen address (0.0.0.0 in containers)",
            default=default_of(ServerOptions, "host"),
        ),
        Setting(prefix, "--port", "listen port (0 = any free port)", type=int, default=default_port),
        Setting(
            prefix,
            "--max-message-bytes",
            "largest gRPC message sent or received (clients must use the same)",
            type=int,
            default=default_of(ServerOptions, "max_message_bytes"),
        ),
        Setting(
            prefix,
            "--grace-s",
            "on SIGTERM: seconds in-flight calls get to finish; streams still open then end with "
            "FINISH_REASON_ABORTED",
            type=float,
            default=DEFAULT_GRACE_S,
        ),
        *server_security_settings(prefix, ""),
    ]


def server_security_settings(prefix: str, help_prefix: str) -> list[Setting]:
    """The TLS and bearer-token files a server takes (`tandem up` passes them to both services)."""
    files = (
        ("--tls-cert", "TLS: server certificate chain (PEM)", "none, plaintext"),
        ("--tls-key", "TLS: the certificate's private key (PEM)", "none"),
        ("--tls-client-ca", "mutual TLS: the CA client certificates must be signed by (PEM)", "none"),
        (
            "--auth-token-file",
            "accepted bearer tokens, one per line; every call but health needs one",
            "none, no authentication",
        ),
    )
    return [
        Setting(prefix, flag, help_prefix + text, type=PATH, default=None, show_default=shown, metavar="FILE")
        for flag, text, shown in files
    ]


def server_options(values: Mapping[str, Any]) -> ServerOptions:
    """ServerOptions from `server_settings` values. Raises ConfigError."""
    options: dict[str, Any] = {k: values[k] for k in ("host", "port", "max_message_bytes", "grace_s")}
    options["tls"] = TlsOptions.from_paths(values["tls_cert"], values["tls_key"], values["tls_client_ca"])
    if values["auth_token_file"] is not None:
        try:
            options["auth_tokens"] = load_tokens(values["auth_token_file"])
        except ValueError as error:
            raise ConfigError("auth_token_file", f": {error}") from None
    return ServerOptions(**options)
