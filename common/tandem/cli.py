"""`tandem`: one command for the services and their tools; `tandem --help` lists every subcommand.

Each subcommand lives in its own module and is imported only when it runs, so `tandem --help` (and
`tandem generate`) never pays for torch: `COMMANDS` holds where each one is and its one-line help.
Options of the client commands read `TANDEM_<COMMAND>_<FLAG>` when not given (e.g.
TANDEM_GENERATE_ADDRESS); the services' own variables are `TANDEM_*`, `TANDEM_ENCODER_*`,
`TANDEM_OPENAI_*` (the gateway) and `TANDEM_UP_*` (`tandem.common.flags`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from tandem.common.flags import CONTEXT_SETTINGS, UINT64, FlagError, option, run

# name -> ("module:factory" of its click command, the line `tandem --help` shows)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tandem.cli:serve_group", "run one service: tandem serve decoder|encoder|openai [flags]"),
    "up": ("tandem.up:command", "run both services in the foreground until Ctrl-C or SIGTERM"),
    "wait": ("tandem.wait_cli:command", "wait until services serve (after `tandem up &`)"),
    "demo": ("tandem.demo:command", "start both services on the default model, ask it a question, stop"),
    "generate": ("tandem.generate_cli:command", "stream a generation from a running decoder"),
    "chat": ("tandem.chat_cli:command", "chat with a running decoder through the model's chat template"),
    "embed": ("tandem.embed_cli:command", "text, token IDs or an image -> embeddings from a running encoder"),
    "import-gguf": ("tandem.cli:import_gguf_command", "convert a GGUF file into a checkpoint directory"),
    "make-model": ("tandem.cli:make_model_command", "write a random-weight checkpoint (tests, benchmarks)"),
    "bench": ("tandem.cli:bench_command", "run the benchmark harness of a source checkout"),
}
SERVICES: dict[str, tuple[str, str]] = {
    "decoder": ("tandem.decoder.api.main:command", "tandem.v1.Decoder: prompts in, streamed tokens out"),
    "encoder": (
        "tandem.encoder.__main__:command",
        "tandem.v1.Encoder: text, token IDs or images in, embeddings out",
    ),
    "openai": ("tandem.gateway.__main__:command", "the OpenAI HTTP API in front of a decoder and an encoder"),
}


class LazyGroup(click.Group):
    """A group whose commands are imported when they run; --help lists them from the table alone."""

    def __init__(self, *args: object, lazy: dict[str, tuple[str, str]], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.lazy)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy:
            return None
        module, factory = self.lazy[name][0].split(":")
        return getattr(importlib.import_module(module), factory)()

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (_, text) in self.lazy.items()])


def group() -> click.Group:
    return LazyGroup(
        "tandem",
        lazy=COMMANDS,
        help="Serve decoder-only LLMs over gRPC to callers that bring their own prompt embeddings.",
        context_settings={**CONTEXT_SETTINGS, "auto_envvar_prefix": "TANDEM"},
    )


def serve_group() -> click.Group:
    return LazyGroup("serve", lazy=SERVICES, help="Run one service in the foreground until SIGTERM.")


def main(argv: Sequence[str] | None = None) -> int:
    return run(group(), argv, "tandem")


def make_model_command() -> click.Command:
    def make(dir: Path, shape: str, seed: int) -> int:
        from tandem.common.torch_part.random_model import SHAPES, make_model

        if shape not in SHAPES:
            raise click.BadParameter(f"{shape!r} is not one of {', '.join(SHAPES)}", param_hint="'--shape'")
        _check_out_dir(dir)
        try:
            click.echo(make_model(dir, shape=shape, seed=seed))
        except OSError as error:  # a folder it may not write
            raise FlagError(f"DIR {dir}: {error.strerror}") from None
        return 0

    return click.Command(
        "make-model",
        params=[
            click.Argument(["dir"], type=click.Path(path_type=Path)),
            option("--shape", "tiny-random, tiny-llama, bench-small or qwen3-0.6b", default="tiny-random"),
            option("--seed", "seed of the random weights", type=UINT64, default=0),  # torch's seed
        ],
        callback=make,
        help="Write a random-weight checkpoint to DIR: for tests and benchmark shapes, its output is noise.",
    )


def import_gguf_command() -> click.Command:
    from tandem.common.dtypes import COMPUTE_NAMES

    return click.Command(
        "import-gguf",
        params=[
            click.Argument(["file"], type=click.Path(path_type=Path)),
            click.Argument(["dir"], type=click.Path(path_type=Path)),
            option(
                "--dtype",
                "dtype of the written weights",
                type=click.Choice(COMPUTE_NAMES),
                default="bfloat16",
            ),
        ],
        callback=_import_gguf,
        help="Convert FILE, a GGUF file (Llama, Qwen2 or Qwen3, any type gguf dequantizes), into the "
        "checkpoint directory DIR.",
    )


def _import_gguf(file: Path, dir: Path, dtype: str) -> int:
    from tandem.common.torch_part.gguf_import import GGUFImportError, ImportProgress, import_gguf

    # A terminal's progress line is rewritten in place with \r; a pipe or a log file would keep every
    # rewrite (272 of them, one long line, for SmolLM2-135M), so it gets one summary line at the end.
    is_live = sys.stderr.isatty()
    last: list[ImportProgress] = []

    def progress(p: ImportProgress) -> None:
        last[:] = [p]
        if is_live:
            print(f"\rimporting {file.name}: {p.num_done}/{p.num_tensors} tensors", end="", file=sys.stderr)

    def fail(line: str) -> int:
        start = "\n" if is_live and last else ""  # after the progress line
        print(f"{start}tandem import-gguf: {line}", file=sys.stderr)
        return 2

    _check_out_dir(dir)
    try:
        import_gguf(file, dir, dtype, on_progress=progress)
    except GGUFImportError as error:
        return fail(str(error))
    except OSError as error:  # writing DIR: a folder it may not write, a full disk
        return fail(f"DIR {dir}: {error.strerror}")
    if is_live:
        print(file=sys.stderr)
    elif last:
        print(f"imported {file.name}: {last[0].num_tensors} tensors", file=sys.stderr)
    print(dir)
    return 0


def _check_out_dir(dir: Path) -> None:
    """DIR, which a tool creates, is a directory or nothing yet: else mkdir failed with a traceback.
    Raises FlagError."""
    if dir.exists() and not dir.is_dir():
        raise FlagError(f"DIR {dir}: a file, not a directory")


def bench_command() -> click.Command:
    def bench(args: tuple[str, ...]) -> int:
        """Replace this process with bench/harness.py of the source checkout, given the same arguments."""
        # common/tandem/cli.py: the checkout is two folders up.
        harness = Path(__file__).resolve().parents[2] / "bench" / "harness.py"
        if not harness.is_file():
            print(
                f"tandem bench: {harness} not found; tandem bench runs from a source checkout",
                file=sys.stderr,
            )
            return 2
        os.execv(sys.executable, [sys.executable, str(harness), *args])
        return 0  # not reached: execv does not return

    return click.Command(
        "bench",
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        callback=bench,
        help="Run bench/harness.py with these arguments (its own --help lists them).",
        add_help_option=False,  # --help goes to the harness
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


if __name__ == "__main__":
    sys.exit(main())
