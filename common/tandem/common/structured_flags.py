"""Structured output for the client commands: --json-schema, --regex, --choice and --grammar, and the
StructuredOutput message their values make."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from tandem.common.flags import PATH, describe_flag, option, read_flag_file

# The decoder's bound on a schema's, regex's or grammar's text (its MAX_SOURCE_CHARS, in
# tandem.decoder.engine.sampling.structured): a longer one is refused there, so a file is read up to the
# bytes that many characters take (4 each at most, UTF-8) and no further. It was read whole:
# `--json-schema /dev/zero` grew `tandem chat` to 22 GB before the host's OOM killer ended it.
MAX_SOURCE_CHARS = 64 * 1024
_SOURCE_BOUND = f"a schema or grammar ({MAX_SOURCE_CHARS:,} characters, the decoder's limit)"


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
            flag = f"--{name.replace('_', '-')}"
            data = read_flag_file(given[name], flag, 4 * MAX_SOURCE_CHARS, _SOURCE_BOUND)
            try:
                # Newlines as read_text read them (universal newlines), as before.
                source = data.decode().replace("\r\n", "\n").replace("\r", "\n")
            except UnicodeDecodeError:
                raise click.BadParameter(f"{given[name]}: not UTF-8 text", param_hint=f"'{flag}'") from None
            if len(source) > MAX_SOURCE_CHARS:
                raise click.BadParameter(
                    f"{given[name]} has {len(source):,} characters, over {_SOURCE_BOUND}",
                    param_hint=f"'{flag}'",
                )
            return structured_output(**{name: source})
    if "regex" in given:
        return structured_output(regex=given["regex"])
    if "choice" in given:
        return structured_output(choice=list(given["choice"]))
    return None
