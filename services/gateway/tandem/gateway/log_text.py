"""What a caller sent, made safe to write into a log line: printable ASCII as it is, every other byte
as `\\xHH`, as nginx's access log escapes it.

NOTE: why every value a caller chose is escaped, not only a newline. A log is read by people and by
programs: a request line, a path or a User-Agent holding a newline (a decoded `%0A`, or U+0085 or
U+2028, which Python's `splitlines` and many log shippers break at) starts a line the caller wrote, a
`"` ends the quoted field early and forges the fields after it, a NUL cuts a C reader's line, and a
right-to-left override (U+202E) shows a person other text than the line holds. aiohttp's parsers let
through obs-text in header values (a UTF-8 U+202E or U+0085 in a User-Agent), and its pure-Python one
in the request target too. Escaped bytes still say what was sent: a `\\` is escaped as well, so
`\\x0A` in a log line was sent as a newline, never typed as those four characters.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with each byte that is not printable ASCII, and `"` and `\\`, written `\\xHH` (the UTF-8
    bytes of any other character; a byte the parser could not decode as itself)."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(
        chr(b) if 0x20 <= b < 0x7F and b not in (0x22, 0x5C) else f"\\x{b:02X}"
        for b in text.encode("utf-8", "surrogateescape")
    )
