"""Files the client commands' flags name (--image, --part image:, --json-schema, --grammar) are read
only if regular and within a bound: one line naming the flag, exit 2, before anything is sent.

They were read whole: `tandem chat --json-schema /dev/zero` grew to 22 GB (the host's OOM killer),
a FIFO hung the command in open(), and a 100 MB image ended in gRPC's RESOURCE_EXHAUSTED naming no flag.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.tests.ports import free_port
from tandem import cli
from tandem.common.flags import MAX_IMAGE_FILE_BYTES
from tandem.common.structured_flags import MAX_SOURCE_CHARS

# Each command with the flag that names a file, its variable as the error line says it; {} is the path.
IMAGE_FLAGS = [
    (["embed", "--image", "{}"], "tandem embed: --image (TANDEM_EMBED_IMAGE): "),
    (["generate", "--part", "image:{}"], "tandem generate: --part image:{}: "),
    (["chat", "--image", "{}"], "tandem chat: --image (TANDEM_CHAT_IMAGE): "),
]
SOURCE_FLAGS = [
    (["generate", "--prompt", "hi", "--json-schema", "{}"], "tandem generate: --json-schema "),
    (["generate", "--prompt", "hi", "--grammar", "{}"], "tandem generate: --grammar "),
    (["chat", "--json-schema", "{}"], "tandem chat: --json-schema "),
    (["chat", "--grammar", "{}"], "tandem chat: --grammar "),
]


def _run(argv: list[str], path: Path | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    # Nothing listens on the addresses: a file let through would fail connecting, exit 1, not 2.
    nowhere = f"127.0.0.1:{free_port()}"
    filled = [a.format(path) for a in argv]
    code = cli.main(
        [*filled, "--address", nowhere, *(["--encoder-address", nowhere] if argv[0] != "embed" else [])]
    )
    return code, capsys.readouterr().err


@pytest.fixture(params=["fifo", "device"])
def not_regular(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A FIFO with no writer (opened without O_NONBLOCK it waits for one for ever) or /dev/null."""
    if request.param == "device":
        return Path("/dev/null")
    fifo = tmp_path / "picture.png"
    os.mkfifo(fifo)
    return fifo


@pytest.mark.parametrize(("argv", "said"), IMAGE_FLAGS + SOURCE_FLAGS)
def test_a_file_that_is_not_regular_is_refused_unread(
    argv: list[str], said: str, not_regular: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run(argv, not_regular, capsys)
    assert code == 2
    assert err.startswith(said.format(not_regular))
    assert err.endswith(f"{not_regular} is not a regular file\n")
    assert err.count("\n") == 1


@pytest.mark.parametrize(("argv", "said"), IMAGE_FLAGS)
def test_an_image_over_what_one_call_carries_is_refused_naming_the_flag_and_the_bound(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.png"
    with big.open("wb") as file:
        file.truncate(MAX_IMAGE_FILE_BYTES + 1)  # sparse: no memory, no disk
    code, err = _run(argv, big, capsys)
    assert code == 2
    assert err == (
        f"{said.format(big)}{big} is over {MAX_IMAGE_FILE_BYTES:,} bytes, the bound of an image "
        "(64 MiB less 64 KiB, what one call to the encoder carries)\n"
    )


@pytest.mark.parametrize(("argv", "said"), SOURCE_FLAGS)
def test_a_schema_or_grammar_over_the_decoders_limit_is_refused_unsent(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bound = f"a schema or grammar ({MAX_SOURCE_CHARS:,} characters, the decoder's limit)"
    huge = tmp_path / "huge.json"
    with huge.open("wb") as file:
        file.truncate(4 * MAX_SOURCE_CHARS + 1)  # more bytes than that many characters take
    code, err = _run(argv, huge, capsys)
    assert code == 2
    assert err.startswith(said)
    assert err.endswith(f"): {huge} is over {4 * MAX_SOURCE_CHARS:,} bytes, the bound of {bound}\n")

    long = tmp_path / "long.json"
    long.write_text("x" * (MAX_SOURCE_CHARS + 1))
    code, err = _run(argv, long, capsys)
    assert code == 2
    assert err.endswith(f"): {long} has {MAX_SOURCE_CHARS + 1:,} characters, over {bound}\n")


def test_the_bounds_are_the_services_own() -> None:
    """What one call carries: the client channel's cap less the encoder's room for other fields."""
    from tandem.client.channel import DEFAULT_MAX_MESSAGE_BYTES

    assert MAX_IMAGE_FILE_BYTES == DEFAULT_MAX_MESSAGE_BYTES - 64 * 1024
