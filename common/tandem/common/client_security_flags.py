"""A client command's side of security: the CA it trusts, its own certificate, the token it sends, as
options and the ChannelSecurity their values make."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from tandem.client.auth import read_token
from tandem.client.channel import ChannelSecurity
from tandem.client.errors import ConfigError
from tandem.client.flag_files import TlsFile, TlsFileError, read_tls_files
from tandem.common.flags import PATH, FlagError, describe_flag, option


def client_security_options() -> list[click.Option]:
    return [
        option("--tls", "use TLS (implied by --tls-ca, --tls-cert)", is_flag=True, default=False),
        option(
            "--tls-ca",
            "CA to trust for the server, PEM",
            type=PATH,
            default=None,
            show_default="system roots",
        ),
        option(
            "--tls-cert", "mutual TLS: client certificate, PEM", type=PATH, default=None, show_default="none"
        ),
        option("--tls-key", "mutual TLS: its private key, PEM", type=PATH, default=None, show_default="none"),
        option(
            "--auth-token-file",
            "file holding the bearer token to send (its first one)",
            type=PATH,
            default=None,
            show_default="none",
        ),
    ]


def client_security(values: Mapping[str, Any], prefix: str = "") -> ChannelSecurity:
    """The channel security `client_security_options` ask for, their values under `prefix` (the
    gateway's `upstream_`: `upstream_tls_ca`, ...). Raises ConfigError naming the value's key
    (`tls_ca`, `upstream_tls_ca`, ...) for half a client pair, a file that cannot be read or used (never
    read whole: /dev/zero passed 3 GB in 3 s; a CA that holds no PEM failed every call), or one that
    holds no token."""
    cert, key = f"{prefix}tls_cert", f"{prefix}tls_key"
    if (values[cert] is None) != (values[key] is None):
        flags = " and ".join("--" + name.replace("_", "-") for name in (cert, key))
        raise ConfigError(key if values[key] is None else cert, f": {flags} go together (mutual TLS)")
    try:
        files = read_tls_files(values[cert], values[key], values[f"{prefix}tls_ca"])
    except TlsFileError as error:
        raise ConfigError(prefix + _CLIENT_TLS_FIELDS[error.file], f": {error}") from None
    token = None
    if values[f"{prefix}auth_token_file"] is not None:
        try:
            token = read_token(values[f"{prefix}auth_token_file"])
        except ValueError as error:
            raise ConfigError(f"{prefix}auth_token_file", f": {error}") from None
    return ChannelSecurity.of(files, token, values[f"{prefix}tls"])


# The value each of a client's TLS files comes from, for a refusal.
_CLIENT_TLS_FIELDS = {
    TlsFile.CERTIFICATE_CHAIN: "tls_cert",
    TlsFile.PRIVATE_KEY: "tls_key",
    TlsFile.CA_BUNDLE: "tls_ca",
}


def checked_client_security(values: Mapping[str, Any]) -> ChannelSecurity:
    """`client_security` for the running client command: a refusal is a FlagError naming its flag
    (`--tls-ca (TANDEM_GENERATE_TLS_CA): /x: No such file or directory`), which exits 2."""
    try:
        return client_security(values)
    except ConfigError as error:
        is_command = click.get_current_context(silent=True) is not None
        flag = describe_flag(error.field) if is_command else "--" + error.field.replace("_", "-")
        raise FlagError(error.said_of(flag)) from None
