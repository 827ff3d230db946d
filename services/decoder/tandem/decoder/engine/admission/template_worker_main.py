"""What runs in a template worker process: one JSON job line in, one JSON reply line out.

template_worker.py starts it as `python -m tandem.decoder.engine.admission.template_worker_main` and
holds the bounds it keeps (MAX_RENDERED_CHARS) and the line it starts with (READY). It imports nothing
of Tandem's but those and the sandbox (template_sandbox.py), so a worker is an interpreter and Jinja2
(no torch, about 20 MB). It caps its own address space before it reads a job; a job holding
`messages` is rendered, one without is only compiled. It keeps the last CACHED_TEMPLATES compiled.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from typing import Any

from tandem.decoder.engine.admission.template_sandbox import sandbox
from tandem.decoder.engine.admission.template_worker import MAX_RENDERED_CHARS, READY

CACHED_TEMPLATES = 64


def main() -> None:
    import resource

    memory_bytes = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    environment = sandbox()
    sys.stdout.buffer.write(READY)  # from here on, a job's time is its template's alone
    sys.stdout.buffer.flush()
    templates: OrderedDict[str, Any] = OrderedDict()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            template = _compiled(environment, templates, request["source"])
            reply = {"text": _render(template, request)} if "messages" in request else {}
        except MemoryError:
            error = f"the template needed more than {memory_bytes >> 20} MiB of memory"
            _reply({"error": error, "retiring": True})
            return  # a process that ran out of memory is not trusted again: the parent starts another
        except _TooLong:
            reply = {"error": f"the rendered prompt exceeds {MAX_RENDERED_CHARS} characters", "field": "chat"}
        except _DoesNotCompile as error:
            reply = {"error": f"the template does not compile: {error}"}
        except Exception as error:  # the template is code: any error it raises is the caller's to see
            reply = {"error": f"the template failed: {_one_line(error)}"}
        _reply(reply)


class _TooLong(Exception):
    pass


class _DoesNotCompile(Exception):
    """Jinja's syntax error, as "line N: message"."""


def _compiled(environment: Any, templates: OrderedDict[str, Any], source: str) -> Any:
    from jinja2 import TemplateSyntaxError

    template = templates.pop(source, None)
    if template is None:
        try:
            template = environment.from_string(source)
        except TemplateSyntaxError as error:  # TemplateAssertionError too: an unknown filter or test
            raise _DoesNotCompile(f"line {error.lineno}: {_one_line(error)}") from None
    templates[source] = template  # most recently used last
    while len(templates) > CACHED_TEMPLATES:
        templates.popitem(last=False)
    return template


def _render(template: Any, request: dict[str, Any]) -> str:
    chunks, size = [], 0
    stream = template.generate(
        messages=request["messages"],
        add_generation_prompt=request["add_generation_prompt"],
        **request["variables"],
    )
    for chunk in stream:
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise _TooLong
        chunks.append(chunk)
    return "".join(chunks)


def _reply(reply: dict[str, Any]) -> None:
    sys.stdout.buffer.write((json.dumps(reply, ensure_ascii=False) + "\n").encode())
    sys.stdout.buffer.flush()


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:500] or type(error).__name__


if __name__ == "__main__":
    main()
