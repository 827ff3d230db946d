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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from tandem.client.errors import ConfigError


class _Path(click.Path):
    """A path, checked by the config that uses it (one rule, one place), except an empty one: click
    turns '' into Path("."), which every config then said as ". : Is a directory"."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail(f"{value!r} is empty: name a path, or leave the flag out", param, ctx)
        return super().convert(value, param, ctx)


PATH = _Path(path_type=Path)

# An image a flag names (--image, --part image:) goes to the encoder in one Embed call, which the client's
# channel caps at DEFAULT_MAX_MESSAGE_BYTES (64 MiB, tandem.client.channel), and the encoder keeps 64 KiB
# of a message for the call's other fields (its SMALL_FIELDS_BYTES): a larger file cannot be sent. It
# was read whole first (/dev/zero: a MemoryError), and a 100 MB one ended in gRPC's RESOURCE_EXHAUSTED
# "Sent message larger than max", naming no flag.
MAX_IMAGE_FILE_BYTES = 64 * 1024 * 1024 - 64 * 1024
IMAGE_FILE_BOUND = "an image (64 MiB less 64 KiB, what one call to the encoder carries)"


def read_flag_file(path: Path | str, flag: str, max_bytes: int, bound: str) -> bytes:
    """The bytes of the file `flag` names: a regular file (a FIFO or a device is refused before it is
    read, so none hangs the command or fills memory) of at most `max_bytes`, `bound` saying whose
    bound. Raises click.BadParameter naming `flag` (and so its variable, `error_line`)."""
    from tandem.client.flag_files import read_bounded

    try:
        return read_bounded(Path(path), max_bytes, bound)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint=f"'{flag}'") from None


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


class _UInt(click.IntRange):
    """An integer in a range, said as one: click's own name made "'abc' is not a valid integer range."."""

    name = "integer"


UINT32 = _UInt(0, 2**32 - 1)  # what a uint32 field of a request can hold (max tokens, top-k)
UINT64 = _UInt(0, 2**64 - 1)  # a uint64 field's (the seed)


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
