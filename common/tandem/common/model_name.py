"""The `model` field of a request: a bounded name, checked against the one this server serves.

A caller's string is never echoed whole into a status: gRPC carries the message in trailing
metadata, whose hard limit (16 KiB by default) turns an echo of a long name into RESOURCE_EXHAUSTED
instead of the NOT_FOUND the caller should see.
"""

from __future__ import annotations

import unicodedata

from tandem.client.errors import InvalidArgument, NotFound

MAX_MODEL_NAME_BYTES = 256  # the longest `model` a request may carry
MAX_ECHO_CHARS = 64  # the most of a caller's string an error message repeats


def echo(text: str) -> str:
    """`text` quoted for an error message, cut to MAX_ECHO_CHARS characters."""
    if len(text) <= MAX_ECHO_CHARS:
        return repr(text)
    return f"{text[:MAX_ECHO_CHARS]!r}... ({len(text)} characters)"


def check_model(requested: str, served: str) -> None:
    """Empty = the served model. Raises InvalidArgument when `requested` is over the bound, NotFound
    when it names another model."""
    if len(requested.encode()) > MAX_MODEL_NAME_BYTES:
        raise InvalidArgument("model", f"at most {MAX_MODEL_NAME_BYTES} bytes, got {len(requested.encode())}")
    if requested and requested != served:
        raise NotFound(f"model {echo(requested)} is not served here (this server serves {served!r})")


def check_adapter_name(name: str, field: str = "name") -> None:
    """A LoRA adapter's name: 1 to MAX_MODEL_NAME_BYTES bytes (it stands for a model name in the
    OpenAI front, as in vLLM). Raises InvalidArgument naming `field`."""
    size = len(name.encode())
    if not 1 <= size <= MAX_MODEL_NAME_BYTES:
        raise InvalidArgument(field, f"must be 1 to {MAX_MODEL_NAME_BYTES} bytes, got {size}")
    check_label(name, field)


# Control characters (newline, carriage return, escape, DEL, ...) and the two Unicode line separators,
# which str.splitlines and many log viewers also break lines at.
_LINE_FORGING = frozenset({"Cc", "Zl", "Zp"})
# Invisible characters that make a twin of another name or reorder a line as it is shown: the
# zero-width space and word joiner, the byte-order mark, the left-to-right / right-to-left and Arabic
# letter marks, and the bidirectional embeddings, overrides and isolates (the "Trojan Source"
# characters): "qv4\u200b" shows as "qv4" in a log line, /v1/models or a trace. A list, not Unicode's
# whole format category (Cf), which also holds what real words and emoji need: the zero-width
# (non-)joiner of Persian and Indic spellings and of emoji sequences, the soft hyphen, flag tags.
_INVISIBLE = frozenset(
    "\u200b\u200e\u200f\u061c\u2060\ufeff\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)


def check_label(text: str, field: str) -> None:
    """A name a caller gives that the server logs and echoes (an adapter's name, a request ID): no
    control characters or line separators, which would forge a log line, and no white space at either
    end, which makes two names nobody can tell apart ("qv4 " beside "qv4"). Raises InvalidArgument
    naming `field`. Nor invisible characters (zero-width spaces, bidirectional controls), which make
    the same kind of twin ("qv4\u200b" beside "qv4") or reorder a log line as it is shown."""
    if any(unicodedata.category(c) in _LINE_FORGING for c in text):
        raise InvalidArgument(field, f"must not hold control characters or line separators, got {echo(text)}")
    invisible = next((c for c in text if c in _INVISIBLE), None)
    if invisible is not None:
        raise InvalidArgument(
            field,
            f"must not hold invisible characters (U+{ord(invisible):04X}: zero-width spaces, byte-order "
            f"marks, direction marks and bidirectional controls), got {echo(text)}",
        )
    if text != text.strip():
        raise InvalidArgument(field, f"must not begin or end with white space, got {echo(text)}")
