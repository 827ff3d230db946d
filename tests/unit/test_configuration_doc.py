"""docs/CONFIGURATION.md's tables list every flag of both services, the gateway and `tandem up`, each with its
environment variable and the default `--help` shows."""

import re
from pathlib import Path

import click
import pytest

from tandem.common.flags import Setting
from tandem.decoder.api.main import command as decoder_command
from tandem.encoder.__main__ import command as encoder_command
from tandem.gateway.__main__ import command as gateway_command
from tandem.up import command as up_command

CONFIGURATION = (Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md").read_text()
ROWS = {
    (flag, env): default
    for flag, env, default in re.findall(
        r"^\| `(--[a-z0-9-]+)` \| `([A-Z0-9_]+)` \| ([^|]+) \|", CONFIGURATION, flags=re.MULTILINE
    )
}


def _settings(command: click.Command) -> list[Setting]:
    return [p for p in command.params if isinstance(p, Setting)]


@pytest.mark.parametrize(
    "command",
    [decoder_command, encoder_command, up_command, gateway_command],
    ids=["decoder", "encoder", "up", "openai"],
)
def test_every_flag_is_documented_with_its_variable_and_default(command) -> None:
    settings = _settings(command())
    assert settings
    missing = [s.opts[0] for s in settings if (s.opts[0], s.envvar) not in ROWS]
    assert not missing, f"docs/CONFIGURATION.md's table lacks {missing}"
    for setting in settings:
        if not isinstance(setting.show_default, str):  # a plain value: the table shows the same
            row = ROWS[(setting.opts[0], setting.envvar)]
            assert f"`{_shown(setting.default)}`" in row, setting.opts[0]


def _shown(default: object) -> str:
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)
