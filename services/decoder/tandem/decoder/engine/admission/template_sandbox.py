"""The Jinja2 environment a chat template renders in: transformers' own, sandboxed.

It is Jinja2's immutable sandbox (no attribute or file escape, no mutation of the arguments) with the
settings, globals, filter and extensions of transformers' apply_chat_template, so that a template
written for transformers renders the same here. It runs in a template worker process
(template_worker_main.py), which bounds what the sandbox does not: time, memory and output. Jinja2 is
imported inside, so that importing this module costs nothing where no template is rendered.
"""

from __future__ import annotations

import json
from typing import Any


def sandbox() -> Any:
    """Jinja2's immutable sandbox with transformers' settings, globals, filter and extensions (its
    apply_chat_template's environment), so templates written for it render the same here, and nothing
    but text and values printed."""
    from datetime import datetime

    from jinja2 import TemplateError, Undefined, nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    printable = (str, int, float, bool, type(None), list, tuple, dict, Undefined)

    def finalize(value: Any) -> Any:
        # Anything else (a function, a macro, a loop object) prints as its repr, which can hold a
        # heap address that the caller would read back through the prompt's logprobs.
        pending = [value]
        while pending:
            item = pending.pop()
            if not isinstance(item, printable):
                raise TemplateError(f"the template printed a {type(item).__name__}, not text or a value")
            if isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list | tuple):
                pending.extend(item)
        return value

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(format: str) -> str:
        # Llama 3.x templates print today's date with it; without it they print "26 Jul 2024".
        return datetime.now().strftime(format)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own escapes HTML characters (`<` as \u003c), which transformers' does not.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` alone, as transformers gives them: not the class,
        whose attributes a template could otherwise reach for."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(Namespace):
        """Jinja's namespace refusing `_`-prefixed attributes, as transformers' does (a way towards
        CPython's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            # Jinja's signature trick, so that `namespace(self=...)` still works.
            self, args = args[0], args[1:]
            attributes = dict(*args, **kwargs)
            for name in attributes:
                TemplateNamespace._check_name(name)
            Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                    f"{name!r}. Please rename the attribute."
                )

    class Generation(Extension):
        """transformers' `{% generation %}...{% endgeneration %}`, which marks the assistant's text for
        training masks (LLaVA's templates use it): here it renders its body and nothing else."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, finalize=finalize, extensions=[Generation, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment
