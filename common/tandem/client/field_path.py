"""A step of a field path into a JSON-like value: an object's key or a list's index, spelled as every
service's refusal spells it (`chat.template_kwargs.flag`, `...["a b"]`, `...[3]`).

A key is what a caller wrote, of any length, and an error repeats its path: past MAX_KEY_CHARS it is cut
(the name shows its first characters and "..."), so a 1 MiB key makes no 1 MiB error. The gateway, the
decoder and bad_utf8's walk of a refused message all name keys so, and a caller finds the same field in
each.
"""

from __future__ import annotations

import json

MAX_KEY_CHARS = 32  # of a key as a path shows it


def quoted_key(key: str) -> str:
    """`key` as a JSON string, cut past MAX_KEY_CHARS characters: `"a b"`, `"aaa...a..."`."""
    cut = key if len(key) <= MAX_KEY_CHARS else key[:MAX_KEY_CHARS] + "..."
    return json.dumps(cut, ensure_ascii=False)


def child_path(path: str, key: str | int) -> str:
    """The path of `key` (an object's key, or a list's index) in the value at `path`: `.key` where the
    key is an identifier of at most MAX_KEY_CHARS, else `[quoted key]` (a cut name is no identifier);
    `[index]`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key.isidentifier() and len(key) <= MAX_KEY_CHARS:
        return f"{path}.{key}"
    return f"{path}[{quoted_key(key)}]"
