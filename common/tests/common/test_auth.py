"""Token files: the format the servers accept and the clients send from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.client.auth import load_tokens, read_token
from tandem.client.flag_files import MAX_TOKEN_FILE_BYTES
from tandem.common.server import ServerOptions


def test_token_file_holds_one_token_a_line_skipping_blank_lines_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("# rotate: new first, old until every client moved\n  new-token \n\nold-token\n")
    assert load_tokens(path) == {"new-token", "old-token"}
    assert read_token(path) == "new-token"  # a client sends the first


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "holds no token"), ("# only a comment\n", "holds no token"), ("two words\n", "token 1 has spaces")],
)
def test_unusable_token_file_is_refused_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_tokens(path)
    assert str(path) in str(error.value)


def test_missing_token_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the auth token file"):
        load_tokens(tmp_path / "absent.txt")


def test_server_options_never_show_their_tokens() -> None:
    assert "s3cret" not in repr(ServerOptions(auth_tokens=frozenset({"s3cret"})))


def test_a_token_file_over_64_kib_is_refused_naming_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("t" * (MAX_TOKEN_FILE_BYTES + 1))
    bound = r"tokens.txt is over 65,536 bytes, the bound of a token file \(64 KiB\)"
    with pytest.raises(ValueError, match=bound):
        load_tokens(path)


def test_a_token_file_at_the_bound_is_read(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("t" * MAX_TOKEN_FILE_BYTES)
    assert read_token(path) == "t" * MAX_TOKEN_FILE_BYTES


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_as_token_file_is_refused_before_reading_it(device: str) -> None:
    # Read whole, /dev/zero grew a decoder to 10.5 GB in 31 s.
    with pytest.raises(ValueError, match=f"{device} is not a regular file"):
        read_token(Path(device))


def test_a_fifo_as_token_file_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    with pytest.raises(ValueError, match="fifo is not a regular file"):
        read_token(path)


def test_an_empty_token_file_path_is_named_empty_not_dot() -> None:
    # click turns `--auth-token-file ''` into Path("."): it was "Is a directory: '.'".
    with pytest.raises(ValueError, match=r"the path is empty \(or '.'\): name a file"):
        read_token(Path(""))


def test_a_token_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"tokens.bin: it is not UTF-8 text"):
        load_tokens(path)
