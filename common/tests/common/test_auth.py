"""Token files: the format the servers accept and the clients send from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.auth import load_tokens, read_token
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
