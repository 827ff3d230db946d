"""What a caller sent is written into a log line as printable ASCII: every other byte, and `"` and `\\`,
as `\\xHH`, so no value a caller chose starts a line, ends a quoted field or reorders what is shown."""

from __future__ import annotations

import pytest

from tandem.gateway.log_text import printable


def test_printable_ascii_is_written_as_it_is() -> None:
    assert printable("GET /v1/models?x=%0A HTTP/1.1") == "GET /v1/models?x=%0A HTTP/1.1"


@pytest.mark.parametrize(
    ("sent", "written"),
    [
        pytest.param("a\nb\rc", "a\\x0Ab\\x0Dc", id="newline"),
        pytest.param("a\x00b", "a\\x00b", id="NUL"),
        pytest.param("a\x85b\u2028c", "a\\xC2\\x85b\\xE2\\x80\\xA8c", id="NEL and LINE SEPARATOR"),
        pytest.param("\u202eevil", "\\xE2\\x80\\xAEevil", id="right-to-left override"),
        pytest.param('x" 200 "y', "x\\x22 200 \\x22y", id="a quote, ending a field"),
        pytest.param("\\x0A", "\\x5Cx0A", id="a backslash, so an escape is never typed"),
        pytest.param("a\udcffb", "a\\xFFb", id="a byte that was not UTF-8"),
    ],
)
def test_every_other_byte_is_escaped(sent: str, written: str) -> None:
    assert printable(sent) == written
    assert written.isascii() and written.isprintable()
