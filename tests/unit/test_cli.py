"""The `tandem` command: every subcommand listed, every flag documented with its default and variable,
and every mistake one line naming the flag and its variable."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest

from tandem import cli
from tandem.decoder.api.main import main as decoder_main
from tandem.encoder.__main__ import main as encoder_main


def _commands() -> Iterator[tuple[str, click.Command, click.Context]]:
    """Every runnable command under `tandem`, with the context --help renders it in."""
    root = cli.group()
    root_ctx = click.Context(root, info_name="tandem", auto_envvar_prefix="TANDEM")
    for name in cli.COMMANDS:
        command = root.get_command(root_ctx, name)
        assert command is not None, name
        ctx = click.Context(
            command, info_name=name, parent=root_ctx, auto_envvar_prefix=f"TANDEM_{name.upper()}"
        )
        if isinstance(command, click.Group):
            for sub_name in command.list_commands(ctx):
                sub = command.get_command(ctx, sub_name)
                assert sub is not None
                yield f"{name} {sub_name}", sub, click.Context(sub, info_name=sub_name, parent=ctx)
        else:
            yield name, command, ctx


def test_tandem_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    rows = out.split("Commands:")[1].splitlines()
    listed = [line.split()[0] for line in rows if line.startswith("  ") and not line.startswith("   ")]
    assert listed == list(cli.COMMANDS)
    assert {"serve", "up", "demo", "generate", "embed", "import-gguf", "make-model"} <= set(listed)
    assert cli.main(["serve", "--help"]) == 0
    assert "decoder" in capsys.readouterr().out


def test_every_flag_of_every_command_shows_its_help_default_and_variable() -> None:
    names = []
    for name, command, ctx in _commands():
        names.append(name)
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            record = param.get_help_record(ctx)
            assert record is not None, f"tandem {name} {param.opts[0]}"
            flag, text = record
            help_text, _, extra = text.rpartition("  [")
            assert help_text.strip(), f"tandem {name} {flag}: no help text"
            assert "env var: TANDEM_" in extra, f"tandem {name} {flag}: no variable in --help"
            assert "default: " in extra, f"tandem {name} {flag}: no default in --help"
    assert {"serve decoder", "serve encoder", "up", "generate", "embed"} <= set(names)


def test_the_encoder_usage_line_says_tandem_serve_encoder(capsys: pytest.CaptureFixture[str]) -> None:
    # `python -m tandem.encoder` runs encoder_main; `tandem serve encoder` goes through the group.
    for run_help in (lambda: encoder_main(["--help"]), lambda: cli.main(["serve", "encoder", "--help"])):
        assert run_help() == 0
        assert capsys.readouterr().out.startswith("Usage: tandem serve encoder [OPTIONS]")


@pytest.mark.parametrize(
    ("variables", "line"),
    [
        (
            {"TANDEM_ENABLE_PREFIX_CACHING": "maybe"},
            "--enable-prefix-caching (TANDEM_ENABLE_PREFIX_CACHING): 'maybe' is not a boolean: use true or "
            "false (or 1/0, yes/no, on/off)",
        ),
        (
            {"TANDEM_MAX_NUM_SEQS": "abc"},
            "--max-num-seqs (TANDEM_MAX_NUM_SEQS): 'abc' is not a valid integer.",
        ),
        ({"TANDEM_MAX_NUM_SEQS": "0"}, "--max-num-seqs (TANDEM_MAX_NUM_SEQS) must be >= 1, got 0"),
        (
            {"TANDEM_DEVICE": "tpu"},
            "--device (TANDEM_DEVICE) must be one of cpu, cuda, neuron (or cuda:N), got 'tpu'",
        ),
        (
            {"TANDEM_GRACE_S": "-1"},
            "--grace-s (TANDEM_GRACE_S) must be a finite number of seconds, 0 or more, got -1.0",
        ),
    ],
)
def test_a_bad_variable_is_one_line_naming_the_flag_and_the_variable(
    variables: dict[str, str], line: str, environ, capsys: pytest.CaptureFixture[str]
) -> None:
    environ(variables)
    assert decoder_main(["--model", "/m"]) == 2
    assert capsys.readouterr().err == f"tandem serve decoder: {line}\n"


def test_a_client_command_names_its_own_variable(environ, capsys: pytest.CaptureFixture[str]) -> None:
    environ({"TANDEM_GENERATE_MAX_TOKENS": "many"})
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        "tandem generate: --max-tokens (TANDEM_GENERATE_MAX_TOKENS): 'many' is not a valid integer.\n"
    )
    assert cli.main(["generate", "--part", "audio:cat.wav"]) == 2
    assert "--part (TANDEM_GENERATE_PART): 'audio:cat.wav' is not KIND:VALUE" in capsys.readouterr().err


def test_an_unknown_flag_points_at_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["up", "--grace", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem up: No such option '--grace'") and err.endswith("(see tandem up --help)\n")
