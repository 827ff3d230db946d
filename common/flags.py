"""Command-line flags the services and the CLI share, and the one way a flag falls back to the environment.

NOTE: one mechanism. A service's options all default to None, meaning "not given". `values()` takes
each one from the command line, else from `<env_prefix><DEST>` (e.g. TANDEM_MAX_NUM_SEQS), parsed by
the flag's own type, and leaves out the rest, so the service's config dataclass supplies every
default in one place. The environment is read when `values()` is called, at start, never at import.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.auth import load_tokens
from common.client import ChannelSecurity
from common.server import TlsOptions


@dataclass(frozen=True)
class PathFlag:
    """A flag that names a file."""

    flag: str  # e.g. "--tls-cert"
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


# A server's TLS and bearer-token files: both services take them, and `tandem up` passes them on.
SERVER_SECURITY = (
    PathFlag("--tls-cert", "TLS: server certificate chain (PEM)"),
    PathFlag("--tls-key", "TLS: server private key (PEM)"),
    PathFlag("--tls-client-ca", "mutual TLS: CA that must sign client certificates"),
    PathFlag("--auth-token-file", "accepted bearer tokens, one per line; every call but health needs one"),
)
# A client's side of the same: the CA it trusts, its own certificate, the token it sends.
CLIENT_SECURITY = (
    PathFlag("--tls-ca", "PEM CA to trust for the server (default: system roots)"),
    PathFlag("--tls-cert", "mutual TLS: client certificate (PEM)"),
    PathFlag("--tls-key", "mutual TLS: client private key (PEM)"),
    PathFlag("--auth-token-file", "file holding the bearer token to send (its first one)"),
)


def flag_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


class ServiceArgumentParser(argparse.ArgumentParser):
    """A service's flags: every one defaults to None and may instead come from `<env_prefix><FLAG>`."""

    def __init__(self, env_prefix: str, **kwargs: Any) -> None:
        super().__init__(
            epilog=f"Each flag may instead be set by {env_prefix}<FLAG>, e.g. {env_prefix}PORT.", **kwargs
        )
        self.env_prefix = env_prefix

    def env_var(self, dest: str) -> str:
        return self.env_prefix + dest.upper()

    def add_flag(self, flag: str, help: str, type: Callable[[str], Any] = str, **kwargs: Any) -> None:
        dest = flag.removeprefix("--").replace("-", "_")
        self.add_argument(flag, type=type, default=None, help=f"{help} [{self.env_var(dest)}]", **kwargs)

    def add_server_security_flags(self) -> None:
        for spec in SERVER_SECURITY:
            self.add_flag(spec.flag, spec.help, Path, metavar="FILE")

    def values(self, args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
        """Flags given, else their environment variables; neither: absent. Raises ValueError naming
        the variable when its value does not parse."""
        values: dict[str, Any] = {}
        for action in self._actions:
            if not action.option_strings or action.dest == "help":
                continue
            value = getattr(args, action.dest, None)
            raw = environ.get(self.env_var(action.dest))
            if value is None and raw:
                parse = action.type if callable(action.type) else str
                try:
                    value = parse(raw)
                except (ValueError, argparse.ArgumentTypeError) as e:
                    raise ValueError(f"{self.env_var(action.dest)}={raw!r}: {e}") from None
            if value is not None:
                values[action.dest] = value
        return values


def server_security(values: Mapping[str, Any]) -> dict[str, Any]:
    """ServerOptions' `tls` and `auth_tokens` from SERVER_SECURITY values. Raises ValueError."""
    security: dict[str, Any] = {
        "tls": TlsOptions.from_paths(
            values.get("tls_cert"), values.get("tls_key"), values.get("tls_client_ca")
        )
    }
    if values.get("auth_token_file") is not None:
        security["auth_tokens"] = load_tokens(values["auth_token_file"])
    return security


def add_client_security_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls", action="store_true", help="use TLS (implied by --tls-ca/--tls-cert)")
    for spec in CLIENT_SECURITY:
        parser.add_argument(spec.flag, type=Path, help=spec.help)


def client_security(args: argparse.Namespace) -> ChannelSecurity:
    """The channel security CLIENT_SECURITY flags ask for. Raises OSError or ValueError."""
    return ChannelSecurity.from_files(
        args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file, is_tls=args.tls
    )
