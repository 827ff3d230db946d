"""Structured output for the client commands: --json-schema, --regex, --choice and --grammar, and the
StructuredOutput message their values make."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from tandem.common.flags import PATH, describe_flag, option


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
