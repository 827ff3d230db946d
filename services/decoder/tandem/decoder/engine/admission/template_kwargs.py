"""A chat's template_kwargs -> the variables a render passes its template, and the caller's text of them
back out of the rendered text.

Caller text stays plain text: whatever a template prints is its own text, whose special-token literals
tokenize as control tokens, and templates print kwargs (Qwen3 `tools | tojson`, Llama 3.1
`date_string`). A message's text is kept plain by being spliced in after rendering
(chat_placeholders.py), which a kwarg's string cannot be: the template may print it twice, not at all,
or changed (`tojson` escapes it). So each string (a value at any depth, or a key) that could take part
in a special-token literal in any case, as chat.py judges message text, reaches the template between a
pair of markers holding a per-render nonce; whatever the template printed between a pair is that string
as the template printed it, and becomes a plain-text part named by the string's field. Strings that
cannot are passed as they are, so they tokenize as transformers' do. A template that cuts a marker
(`x[30:]`, escaped markers) leaves the nonce outside a pair: the chat is refused naming the string's
field, never tokenized. One that prints a piece with neither marker (`x[34:-35]`) leaves no nonce:
chat.py tells it by a second render with each string at risk inert (`stand_in`,
`TemplateKwargs.at_risk`). The template sees the markers: `x | length` counts them, and `x == '...'` is
false.

Size: the strings and keys hold at most MAX_KWARGS_CHARS in all (check_size, from check_spec), an OpenAI
body's `documents` (a kwarg here) included; a refusal names `documents` where they hold the most.

Numbers: tandem.v1.ChatPrompt.template_kwargs is a google.protobuf.Struct, which holds doubles only, so
`{"n": 3}` arrives as 3.0 and a template printed `3.0` or failed on `range(n)` (transformers and vLLM
pass JSON's 3 as an int). A double that is a whole number within 2**53 (where doubles hold every
integer exactly) reaches the template as an int; so does a caller's 3.0, which JSON cannot tell apart.
Other doubles stay floats, whole ones past 2**53 included: the Struct cannot tell a JSON 1e300 (a float
to vLLM, printed 1e+300) from a rounded integer, so only the gateway, which reads the JSON, refuses an
integer past 2**53.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.field_path import child_path
from tandem.common.torch_part.prompt_parts import TextPrompt

FIELD = "chat.template_kwargs"
MAX_INDEX_DIGITS = 6  # of a marker's index: a million strings, far past what MAX_KWARGS_CHARS holds
# A marker of any nonce, read in one pass (a pattern spanning a pair rescanned the rest of the text from
# each unclosed opening: 183 s for 1 MiB of them), compiled once: the nonce is checked per match, where
# a pattern holding it was compiled on every render (a new nonce misses re's cache). Case-blind: an
# upper-cased string keeps its pair.
_MARKER = re.compile(rf"<<(/?)tandem-text-([0-9a-f]+)-(\d{{1,{MAX_INDEX_DIGITS}}})>>", re.I)
MAX_EXACT_INTEGER = 2**53  # doubles hold every integer up to it exactly
# Characters of every string and key, at any depth: each is read for special literals on a chat
# builder thread (64 MiB of them took 4.4 s on a 267-literal vocabulary), and templates read a handful
# of flags. As much as a render may print (template_worker.MAX_RENDERED_CHARS).
MAX_KWARGS_CHARS = 1 << 20


@dataclass
class TemplateKwargs:
    """The caller's kwargs as the template gets them, and how to find their marked text after. Not
    frozen: mark() adds to its lists, chat.py's marking of names after it is built too."""

    variables: dict[str, Any]  # marked strings, whole numbers as ints; passed as template variables
    marked: list[str]  # the field path of each marked string (a message's name too), by its markers' index
    nonce: str  # the per-render secret in every marker; text the caller sent cannot hold it
    at_risk: list[str] = field(default_factory=list)  # the field path of each marked string at risk


def template_kwargs(
    kwargs: dict[str, Any],
    could_form_special: Callable[[str], bool],
    nonce: str,
    stand_in: Callable[[str], str] = str,
) -> TemplateKwargs:
    """`kwargs` with each string at risk marked (as `stand_in` of it) and each whole-number double an
    int."""
    result = TemplateKwargs({}, [], nonce)

    def convert(value: Any, path: str) -> Any:
        if isinstance(value, str):
            return mark(result, stand_in(value), path) if could_form_special(value) else value
        if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_EXACT_INTEGER:
            return int(value)
        if isinstance(value, dict):
            return {
                mark(result, stand_in(key), child_path(path, key))
                if could_form_special(key)
                else key: convert(item, child_path(path, key))
                for key, item in value.items()
            }
        if isinstance(value, list):
            return [convert(item, child_path(path, i)) for i, item in enumerate(value)]
        return value

    # Top-level keys are variable names, which a template cannot print.
    result.variables.update({key: convert(value, child_path(FIELD, key)) for key, value in kwargs.items()})
    return result


def check_size(kwargs: dict[str, Any]) -> None:
    """Refuses kwargs whose strings and keys hold more than MAX_KWARGS_CHARS characters in all."""

    def size(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, dict):
            return sum(len(key) + size(item) for key, item in value.items())
        if isinstance(value, list):
            return sum(map(size, value))
        return 0

    if (num_chars := size(kwargs)) > MAX_KWARGS_CHARS:
        # Named by what holds the most of them: an OpenAI body's documents reach here as a kwarg.
        in_documents = size(kwargs.get("documents"))
        held = f" ({in_documents} of them in documents)" if in_documents else ""
        raise InvalidArgument(
            f"{FIELD}.documents" if 2 * in_documents > num_chars else FIELD,
            f"{num_chars} characters of strings and keys{held} exceed the limit of {MAX_KWARGS_CHARS}",
        )


def mark(kwargs: TemplateKwargs, text: str, path: str, at_risk: bool = True) -> str:
    """`text` between a new pair of markers, whose printed text `unmark` gives back as plain text at
    `path`. chat.py marks a message's name so too, whatever it holds, at risk or not."""
    kwargs.marked.append(path)
    if at_risk:
        kwargs.at_risk.append(path)
    k = len(kwargs.marked) - 1
    return f"<<tandem-text-{kwargs.nonce}-{k}>>{text}<</tandem-text-{kwargs.nonce}-{k}>>"


def unmark(text: str, kwargs: TemplateKwargs) -> list[tuple[str, TextPrompt]]:
    """The rendered text as the template's own (at "chat") and the marked strings as the template
    printed them (plain, at their fields), in order. Raises InvalidArgument where a pair is broken."""
    if not kwargs.marked:
        return [("chat", TextPrompt(text))] if text else []
    nonce = kwargs.nonce.lower()
    parts: list[tuple[str, TextPrompt]] = []
    position = 0
    opened: re.Match[str] | None = None
    for match in _MARKER.finditer(text):
        if match.group(2).lower() != nonce:  # a caller's look-alike: text, read by _check_unbroken
            continue
        path = _path_of(match.group(3), kwargs)
        piece = text[position : match.start()]
        is_closing = bool(match.group(1))
        if opened is None and not is_closing:  # what came before was the template's
            _check_unbroken(piece, kwargs)
            if piece:
                parts.append(("chat", TextPrompt(piece)))
            opened = match
        elif opened is not None and is_closing and opened.group(3) == match.group(3):
            _check_unbroken(piece, kwargs, path)  # another string printed inside it, changed
            if piece:
                parts.append((path, TextPrompt(piece, is_plain=True)))
            opened = None
        else:  # a pair cut, or one printed inside another
            _refuse(_path_of(opened.group(3), kwargs) if opened is not None else path)
        position = match.end()
    if opened is not None:
        _refuse(_path_of(opened.group(3), kwargs))
    _check_unbroken(text[position:], kwargs)
    if position < len(text):
        parts.append(("chat", TextPrompt(text[position:])))
    return parts


def _check_unbroken(printed: str, kwargs: TemplateKwargs, path: str | None = None) -> None:
    """Refuses text that holds a piece of a marker: the string it marked was printed cut or changed,
    and what is left of it would tokenize as the template's own. `path`: the string it stands in."""
    lowered = printed.lower()  # the nonce is lowercase hex: an upper-cased marker is found too
    nonce = kwargs.nonce.lower()
    if (start := lowered.find(nonce)) >= 0:
        end = start + len(nonce)
        index = _digits(lowered, end + 1, 1) if lowered[end : end + 1] == "-" else None
        _refuse(path or _path_of(index, kwargs))
    # `| reverse` reverses the markers with the text: neither pair nor nonce is read, and a string's
    # '>|trats_mi|<' prints '<|im_start|>' as the template's own text.
    if (start := lowered.find(nonce[::-1])) >= 0:
        index = _digits(lowered, start - 2, -1) if lowered[start - 1 : start] == "-" else None
        _refuse(path or _path_of(index and index[::-1], kwargs))


def _digits(text: str, at: int, step: int) -> str | None:
    """The decimal digits of `text` from `at` on, going by `step` (1 or -1), at most MAX_INDEX_DIGITS
    of them, in text order; None where there is none."""
    end = at
    while 0 <= end < len(text) and abs(end - at) < MAX_INDEX_DIGITS and text[end].isdecimal():
        end += step
    if end == at:
        return None
    return text[at:end] if step > 0 else text[end + 1 : at + 1]


def _path_of(index: str | None, kwargs: TemplateKwargs) -> str:
    """The field of the string whose markers hold `index` (FIELD where the template made one up)."""
    k = int(index) if index is not None else len(kwargs.marked)
    return kwargs.marked[k] if k < len(kwargs.marked) else FIELD


def _refuse(path: str) -> None:
    raise InvalidArgument(
        path,
        "was printed cut or changed by the template (a piece of it outside the markers that keep it plain "
        "text), so it could not be kept plain text",
    )
