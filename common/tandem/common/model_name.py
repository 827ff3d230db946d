"""The `model` field of a request: a bounded name, checked against the one this server serves.

A caller's string is never echoed whole into a status: gRPC carries the message in trailing
metadata, whose hard limit (16 KiB by default) turns an echo of a long name into RESOURCE_EXHAUSTED
instead of the NOT_FOUND the caller should see.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from tandem.client.errors import ConfigError, InvalidArgument, NotFound

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


def check_served_name(name: str) -> None:
    """The name a service serves under (its --model-name, or the model directory's or file's name):
    one a request can name. Raises ConfigError on model_name naming the limit. A name that is not
    UTF-8 (surrogate-escaped bytes) failed every reply that carries it; a longer one pushed the
    encoder's replies past their room for it (request.py's RESPONSE_OVERHEAD_BYTES)."""
    try:
        num_bytes = len(name.encode())
    except UnicodeEncodeError:
        raise ConfigError(
            "model_name", "must be valid UTF-8 (unset, it is the model directory's or file's name)"
        ) from None
    if num_bytes > MAX_MODEL_NAME_BYTES:
        raise ConfigError(
            "model_name",
            f"must be at most {MAX_MODEL_NAME_BYTES} bytes of UTF-8 (the longest `model` a request may "
            f"name), got {num_bytes}",
        )
    try:
        # It is logged, traced and listed (/v1/models) as an adapter's name is: a newline in it forged
        # a log line, and an invisible or trailing character made a twin of another name.
        check_label(name, "model_name")
    except InvalidArgument as error:
        raise ConfigError("model_name", error.description) from None


def served_model_name(model_name: str | None, model: Path, display_name: str) -> str:
    """The name a service serves under: its --model-name `model_name`, or where the flag is not given
    `display_name`, --model `model`'s directory's or file's name (model_cache.model_display_name).

    Raises ConfigError naming the flag the operator can change. An empty flag (model_name) served
    under the directory's name while the operator asked for none. A name taken from the path the
    operator gave for another reason (model_dir: --model) that cannot be served is refused there,
    naming --model-name as the way out: the rule's refusal named a --model-name never given ('My
    Model ', a trailing space), and `--model .` served under '' and `--model /x/..` under '..'."""
    if model_name == "":
        raise ConfigError(
            "model_name", "must name a model, got '' (leave the flag out for the directory's or file's name)"
        )
    if model_name is not None:
        return model_name  # the config checks it (check_served_name), naming the flag
    if display_name in ("", ".", ".."):
        why = "a path ending in '.' or '..', or the root, has no name of its own"
    elif not display_name.isascii() and not _is_utf_8(display_name):  # bytes os.fsdecode escaped
        why = "a model name must be valid UTF-8"
    else:
        try:
            check_served_name(display_name)
            return display_name
        except ConfigError as error:
            why = f"a model name {error.reason}"
    what = "file's" if model.suffix == ".gguf" else "directory's"
    raise ConfigError(
        "model_dir",
        f": the {what} name {echo(display_name)} cannot be served as a model name ({why}): give --model-name",
    )


def _is_utf_8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_adapter_name(name: str, field: str = "name") -> None:
    """A LoRA adapter's name: 1 to MAX_MODEL_NAME_BYTES bytes (it stands for a model name in the
    OpenAI front, as in vLLM), a label (`check_label`), and in Unicode's composed form (NFC): "café"
    spelled with U+00E9 and spelled "e" + U+0301 look the same and were two adapters, each listed,
    loaded and named in requests apart. Raises InvalidArgument naming `field`."""
    size = len(name.encode())
    if not 1 <= size <= MAX_MODEL_NAME_BYTES:
        raise InvalidArgument(field, f"must be 1 to {MAX_MODEL_NAME_BYTES} bytes, got {size}")
    check_label(name, field)
    if not unicodedata.is_normalized("NFC", name):
        raise InvalidArgument(
            field,
            f"must be in Unicode's composed form (NFC), as {echo(unicodedata.normalize('NFC', name))}, "
            f"got {echo(name)}: the two spellings look alike",
        )


# Control characters (newline, carriage return, escape, DEL, ...) and the two Unicode line separators,
# which str.splitlines and many log viewers also break lines at.
_LINE_FORGING = frozenset({"Cc", "Zl", "Zp"})
# Unicode's default-ignorable code points (DerivedCoreProperties.txt, Default_Ignorable_Code_Point),
# which a font shows as nothing where it has no use for them: the zero-width spaces and joiners, the
# direction marks and bidirectional controls (the "Trojan Source" characters, which reorder what
# follows them), invisible operators and separators, fillers, variation selectors, tags, the soft
# hyphen, the byte-order mark: "qv4\u200b", "q\u2063v4" and "qv4\ufe0f" all show as "qv4" in a log
# line, /v1/models or a trace.
_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)  # fmt: skip
_JOINERS = "\u200c\u200d"  # zero-width non-joiner and joiner
_PRESENTATION = "\ufe0e\ufe0f"  # text and emoji presentation selectors
_BLACK_FLAG, _TAGS = "\U0001f3f4", (0xE0020, 0xE007F)  # a subdivision flag: the black flag, then tags


_IGNORABLE_RE = re.compile("[" + "".join(f"{chr(low)}-{chr(high)}" for low, high in _IGNORABLE) + "]")


def _is_ignorable(c: str) -> bool:
    return _IGNORABLE_RE.match(c) is not None


def _is_shown(c: str) -> bool:
    """A character that shows itself, outside ASCII (where a joiner or a selector has work to do)."""
    return ord(c) > 0x7F and not _is_ignorable(c) and not c.isspace()


def _hidden(text: str) -> str | None:
    """The first default-ignorable character of `text` that has no visible work where it stands, or
    None. The exceptions are those words and emoji need, as IDNA's contextual rules allow them: a
    joiner between two shown characters outside ASCII (the zero-width non-joiner of a Persian or Indic
    word, the joiner of an emoji sequence), a presentation selector after one, tags after the black
    flag (a subdivision's flag). Anywhere else, next to ASCII or at either end, it makes a twin."""
    for found in _IGNORABLE_RE.finditer(text):  # one pass in C; the loop only where one stands
        i, c = found.start(), found.group()
        before, after = text[i - 1 : i], text[i + 1 : i + 2]
        if c in _JOINERS and before and after and _is_shown(before) and _is_shown(after):
            continue
        if c in _PRESENTATION and before and _is_shown(before):
            continue
        if _TAGS[0] <= ord(c) <= _TAGS[1] and (
            before == _BLACK_FLAG or (before and _TAGS[0] <= ord(before) <= _TAGS[1])
        ):
            continue
        return c
    return None


def check_label(text: str, field: str) -> None:
    """A name a caller gives that the server logs and echoes (an adapter's name, a request ID): no
    control characters or line separators, which would forge a log line, and no white space at either
    end, which makes two names nobody can tell apart ("qv4 " beside "qv4"). Raises InvalidArgument
    naming `field`. Nor invisible characters (zero-width spaces, bidirectional controls: `_hidden`),
    which make the same kind of twin ("qv4\u200b" beside "qv4") or reorder a log line as it is shown."""
    if any(unicodedata.category(c) in _LINE_FORGING for c in text):
        raise InvalidArgument(field, f"must not hold control characters or line separators, got {echo(text)}")
    invisible = _hidden(text)
    if invisible is not None:
        raise InvalidArgument(
            field,
            f"must not hold invisible characters (U+{ord(invisible):04X}: zero-width spaces and joiners, "
            f"direction marks, bidirectional controls, selectors outside a word or emoji), "
            f"got {echo(text)}",
        )
    if text != text.strip():
        raise InvalidArgument(field, f"must not begin or end with white space, got {echo(text)}")
