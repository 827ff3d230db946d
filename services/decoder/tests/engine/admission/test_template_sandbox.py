"""The sandbox a chat template renders in: what transformers' apply_chat_template gives a template
(globals, filters, extensions), nothing more, and no way towards CPython's internals."""

from __future__ import annotations

import pytest
from jinja2 import TemplateError
from transformers.utils.chat_template_utils import _compile_jinja_template

from tandem.decoder.engine.admission.template_sandbox import sandbox

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_template_gets_the_globals_transformers_gives_it() -> None:
    # strftime_now was missing, so Llama 3.x templates printed their fallback "26 Jul 2024".
    assert set(sandbox().globals) == set(_compile_jinja_template("").environment.globals)


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in [1, 2, 3] %}{% if m == 2 %}{% continue %}{% endif %}{{ m }}{% endfor %}",
        "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}",
        "{{ {'b': 'é', 'a': [1, 2]} | tojson(sort_keys=true, separators=(',', ':')) }}",
        "{{ {'b': 'é'} | tojson(ensure_ascii=true, indent=2) }}",
        "{{ dict(a=1) | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}",
        # dict is not the builtin class, whose other attributes a template could reach: False in both.
        "{{ dict.keys is defined }}",
        # The namespace's name check is private, as in transformers (_check_name): False in both.
        "{{ namespace.check_name is defined }}{{ namespace._check_name is defined }}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    ],
)
def test_a_template_renders_as_in_transformers(source: str) -> None:
    variables = {"messages": MESSAGES, "add_generation_prompt": True}
    reference = _compile_jinja_template(source).render(**variables)
    assert sandbox().from_string(source).render(**variables) == reference


def test_a_namespace_refuses_an_underscore_attribute_as_transformers_does() -> None:
    for source in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        with pytest.raises(TemplateError, match="underscore-prefixed"):
            _compile_jinja_template(source).render()
        with pytest.raises(TemplateError, match="underscore-prefixed"):
            sandbox().from_string(source).render()
