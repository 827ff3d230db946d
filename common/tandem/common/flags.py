"""One configuration layer for every `tandem` command, on click.

NOTE: one mechanism. Every option has a help text, a default and an environment variable, and
`--help` shows all three. A value comes from the command line, else from its variable, else from its
default; a service's defaults are its config dataclass's own (`default_of`), so each lives in one
place. The services name their variables (`TANDEM_<FLAG>` for the decoder, `TANDEM_ENCODER_<FLAG>`,
`TANDEM_OPENAI_<FLAG>` for the gateway, `TANDEM_UP_<FLAG>`); the client commands get click's automatic
`TANDEM_<COMMAND>_<FLAG>`. Click
reads the environment when a command runs, never at import.

Every error is one line that names the flag and its variable: a value that does not parse (click's
own check, by the option's type) and a value the config refuses (`ConfigError`, mapped back to its
option through `Setting.field`).

Why click: it is kept by Pallets and carries typer and most Python CLIs; an option's `envvar`,
`show_envvar` and `show_default` are built in, and its parse errors already name the variable.
pydantic-settings validates as well, but its command line shows no variables in `--help`;
jsonargparse does, at the price of a much larger dependency for the same result.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from tandem.client.auth import load_tokens, read_token
from tandem.client.channel import ChannelSecurity
from tandem.client.errors import ConfigError
from tandem.client.flag_files import TlsFile, TlsFileError, read_tls_files
from tandem.common.server import DEFAULT_GRACE_S, ServerOptions, TlsOptions


class _Path(click.Path):
    """A path, checked by the config that uses it (one rule, one place), except an empty one: click
    turns '' into Path("."), which every config then said as ". : Is a directory"."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail(f"{value!r} is empty: name a path, or leave the flag out", param, ctx)
        return super().convert(value, param, ctx)


PATH = _Path(path_type=Path)


class _Bool(click.ParamType):
    """true/false, also 1/0, yes/no, on/off; anything else is refused saying so."""

    name = "BOOLEAN"
    _VALUES = {
        "true": True,
        "1": True,
        "yes": True,
        "on": True,
        "false": False,
        "0": False,
        "no": False,
        "off": False,
    }

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        if isinstance(value, bool):
            return value
        parsed = self._VALUES.get(str(value).strip().lower())
        if parsed is None:
            self.fail(f"{value!r} is not a boolean: use true or false (or 1/0, yes/no, on/off)", param, ctx)
        return parsed


BOOL = _Bool()


class _Text(click.ParamType):
    """Text, refused when not UTF-8: a shell passes $'\\xff' as bytes that Python holds as surrogate
    escapes, which failed only when sent (a protobuf string, a gRPC host) with a UnicodeEncodeError
    traceback. Every text flag's type unless it names another."""

    name = "TEXT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            self.fail("is not UTF-8 text", param, ctx)
        return text


TEXT = _Text()


def _text_unless_typed(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with TEXT as the type of an option that names none and holds text (click would take a
    str, or the type of a default that is not)."""
    default = kwargs.get("default")
    is_text = (
        default is None
        or isinstance(default, str)
        or (isinstance(default, tuple) and all(isinstance(d, str) for d in default))
    )
    if "type" not in kwargs and not kwargs.get("is_flag") and is_text:
        kwargs["type"] = TEXT
    return kwargs


class _Sizes(click.ParamType):
    """A comma-separated list of positive integers ("16,64,128"); the config checks their order. An
    empty list is refused rather than read as the default: `--seq-buckets ""` (a script's variable left
    empty) silently served the default buckets, and vLLM's list flags (nargs="+") refuse an empty list
    too. Leave the flag out for the default."""

    name = "SIZES"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if not text:
            # The value as given ("  " was said as ''), and the way back to the default where it came
            # from: a variable is unset, not left out.
            is_variable = (
                ctx is not None
                and param is not None
                and param.name is not None
                and ctx.get_parameter_source(param.name) is click.core.ParameterSource.ENVIRONMENT
            )
            remedy = "unset the variable" if is_variable else "leave the flag out"
            self.fail(
                f"{value!r} is an empty list: give at least one size (e.g. 16,64,128), or {remedy} for "
                "its default",
                param,
                ctx,
            )
        try:
            sizes = tuple(int(part) for part in text.split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers (e.g. 16,64,128)", param, ctx)
        return sizes


SIZES = _Sizes()


class _Seconds(click.ParamType):
    """A finite number of seconds, 0 or more: float() takes "nan" (every `< 0` check passes it, and
    a wait for NaN seconds never ends) and "inf". (`tandem wait --timeout-s`, where inf means no limit
    and 0 is refused, has a type of its own: wait_cli._Timeout.)"""

    name = "SECONDS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not (math.isfinite(seconds) and seconds >= 0):
            self.fail(f"must be a finite number of seconds, 0 or more, got {value!r}", param, ctx)
        return seconds


SECONDS = _Seconds()
# The help of every command: `[env var: ...; default: ...]` after each option, up to 100 columns wide.
CONTEXT_SETTINGS: dict[str, Any] = {"max_content_width": 100, "help_option_names": ["-h", "--help"]}


class Setting(click.Option):
    """A service option: its flag, variable (`<prefix><FLAG>`), default and help, and its config field."""

    def __init__(self, prefix: str, flag: str, help: str, *, field: str | None = None, **kwargs: Any) -> None:
        name = flag.removeprefix("--").replace("-", "_")
        kwargs.setdefault("show_default", True)
        super().__init__(
            [flag, name],
            help=help,
            envvar=prefix + name.upper(),
            show_envvar=True,
            allow_from_autoenv=False,  # the variable above, never a second one from the command path
            **_text_unless_typed(kwargs),
        )
        self.field = field or name  # the config field it fills: what a ConfigError names


def option(flag: str, help: str, **kwargs: Any) -> click.Option:
    """A client command's option: its default and its automatic `TANDEM_<COMMAND>_<FLAG>` in --help."""
    kwargs.setdefault("show_default", "off" if kwargs.get("is_flag") else True)
    return click.Option([flag], help=help, show_envvar=True, **_text_unless_typed(kwargs))


def default_of(cls: type, name: str) -> Any:
    """A dataclass field's default, so that a flag's default is the config's own."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default


UINT32 = click.IntRange(0, 2**32 - 1)  # what a uint32 field of a request can hold (max tokens, top-k)
UINT64 = click.IntRange(0, 2**64 - 1)  # a uint64 field's (the seed)


def is_token_ids(text: str) -> bool:
    """ "1,2,3": comma-separated integers a token ID (a uint32) can hold."""
    # ASCII digits only (str.isdigit takes '²', which int() refuses, and '٣', which it reads), and
    # at most 10 of them before int(), which refuses over 4,300 digits in words of its own.
    ids = [i.strip() for i in text.split(",")]
    return all(i.isascii() and i.isdigit() and _below_2_32(i.lstrip("0") or "0") for i in ids)


def _below_2_32(digits: str) -> bool:
    return len(digits) <= 10 and int(digits) < 2**32  # leading zeros stripped: int() counts them


def describe_flag(name: str) -> str:
    """`describe` of the running command's option `name`, e.g. "--max-tokens (TANDEM_GENERATE_MAX_TOKENS)"."""
    ctx = click.get_current_context()
    return describe(next(p for p in ctx.command.params if p.name == name), ctx)


def describe(param: click.Parameter, ctx: click.Context | None = None) -> str:
    """`--max-num-seqs (TANDEM_MAX_NUM_SEQS)`: the flag and where else its value may come from."""
    flag = next((o for o in param.opts if o.startswith("--")), param.name or "?")
    envvar = param.envvar if isinstance(param, click.Option) and isinstance(param.envvar, str) else None
    if envvar is None and isinstance(param, click.Option) and param.allow_from_autoenv:
        ctx = ctx or click.get_current_context(silent=True)
        if ctx is not None and ctx.auto_envvar_prefix and param.name:
            envvar = f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
    return f"{flag} ({envvar})" if envvar else flag


class FlagError(click.UsageError):
    """A config error said with the flag and its variable; exits 2 like every usage error."""


def flag_error(command: click.Command, error: ConfigError) -> FlagError:
    """`error` as one line about the option that fills `error.field` (or as it is, if none does)."""
    for param in command.params:
        if isinstance(param, Setting) and error.field in (param.field, param.name):
            return FlagError(error.said_of(describe(param)))
    return FlagError(str(error))


def error_line(error: click.ClickException) -> str:
    """One line for any click error: a bad value names its flag and variable, the rest as click says."""
    if isinstance(error, click.BadParameter) and not isinstance(error, click.MissingParameter):
        param = error.param
        if param is None and error.ctx is not None and isinstance(error.param_hint, str):
            hint = error.param_hint.strip("'")  # raised by a command's own check, naming its flag
            param = next((p for p in error.ctx.command.params if hint in p.opts), None)
        if param is not None:
            return f"{describe(param, error.ctx)}: {error.message}"
    return error.format_message()


def run(command: click.Command, argv: Sequence[str] | None, prog_name: str) -> int:
    """Run `command` as `prog_name ARGV`; returns its exit code. Errors are one line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = command.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.ClickException as error:
        ctx = getattr(error, "ctx", None)
        where = ctx.command_path if ctx is not None else prog_name
        # Unknown options and the like point at --help; a value's error says all there is to say.
        is_usage = isinstance(error, click.UsageError) and not isinstance(
            error, FlagError | click.BadParameter
        )
        hint = f" (see {where} --help)" if is_usage else ""
        print(f"{where}: {error_line(error)}{hint}", file=sys.stderr)
        return error.exit_code
    except click.Abort:  # Ctrl-C at a prompt
        return 130
    return code if isinstance(code, int) else 0


# -- what both services share: how they listen, drain, and secure their port ---------------------------


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


# -- a client's side: the CA it trusts, its own certificate, the token it sends ------------------------


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
    return ChannelSecurity(
        is_tls=values[f"{prefix}tls"],
        root_certificates=files.ca_bundle,
        certificate_chain=files.certificate_chain,
        private_key=files.private_key,
        token=token,
    )


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


# -- structured output, for the client commands ----------------------------------------------------


def structured_options() -> list[click.Option]:
    """--json-schema FILE, --regex, --choice (repeatable) and --grammar FILE: at most one of them."""
    return [
        option("--json-schema", "the answer is JSON this schema (a file) validates", type=PATH, default=None,
               show_default="none"),
        option("--regex", "the answer matches this regular expression", default=None, show_default="none"),
        option("--choice", "the answer is one of these strings (repeatable)", multiple=True,
               show_default="none"),
        option("--grammar", "the answer follows this Lark grammar (a file)", type=PATH, default=None,
               show_default="none"),
    ]  # fmt: skip


def structured_fields() -> dict[str, str]:
    """The request fields `structured_options` set -> their flags, as the running command names them."""
    return {
        "structured": "--json-schema / --regex / --choice / --grammar",
        **{
            f"structured.{kind}": describe_flag(kind)
            for kind in ("json_schema", "regex", "choice", "grammar")
        },
    }


def structured_choice(values: Mapping[str, Any]) -> Any:
    """The StructuredOutput message `structured_options` ask for, or None. Raises click.UsageError for
    two at once, click.BadParameter naming the flag for a file that cannot be read."""
    from tandem.client.client import structured_output

    given = {
        name: values[name]
        for name in ("json_schema", "regex", "choice", "grammar")
        if values[name] not in (None, ())
    }
    if len(given) > 1:
        raise click.UsageError(
            f"give at most one of --json-schema, --regex, --choice, --grammar (got {len(given)})"
        )
    for name in ("json_schema", "grammar"):
        if name in given:
            try:
                source = Path(given[name]).read_text()
            except (OSError, UnicodeDecodeError) as error:
                reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
                raise click.BadParameter(
                    f"{given[name]}: {reason}", param_hint=f"'--{name.replace('_', '-')}'"
                ) from None
            return structured_output(**{name: source})
    if "regex" in given:
        return structured_output(regex=given["regex"])
    if "choice" in given:
        return structured_output(choice=list(given["choice"]))
    return None
