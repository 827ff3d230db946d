"""Template workers: a chat template renders in a process of its own, bounded in memory, time and
output; a template past a bound fails alone, its worker is replaced, and others keep rendering."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tandem.decoder.engine.admission.template_worker import (
    MAX_RENDERED_CHARS,
    TemplateFailed,
    TemplateWorkers,
)

MESSAGES = [{"role": "user", "content": "hi"}]
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# Runs 10^10 empty iterations: nothing printed, so only a time bound ends it.
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def workers() -> Iterator[TemplateWorkers]:
    workers = TemplateWorkers(time_limit_s=1.0)
    yield workers
    workers.close()


def _render(workers: TemplateWorkers, source: str, **variables: object) -> str:
    return workers.render(source, MESSAGES, True, variables)


def test_a_template_renders_with_its_messages_and_variables(workers: TemplateWorkers) -> None:
    assert _render(workers, CHATML) == "<|im_start|>user\nhi<|im_end|>\n"
    assert _render(workers, "{{ bos }}{{ add_generation_prompt }}", bos="<s>") == "<s>True"


@pytest.mark.parametrize(
    "source",
    [
        "{% set x = 'a' * 10**9 %}{{ x | length }}",  # 5.4 GB before
        "{{ 'a' | center(10**9) | length }}",  # 16.5 s of silence before
        "{% set x = [0] * 10**9 %}{{ x | length }}",
    ],
)
def test_a_template_that_needs_too_much_memory_fails_and_its_worker_is_replaced(
    workers: TemplateWorkers, source: str
) -> None:
    with pytest.raises(TemplateFailed, match="MiB of memory"):
        _render(workers, source)
    assert _render(workers, CHATML).startswith("<|im_start|>user")  # a fresh worker


def test_the_next_render_after_an_out_of_memory_one_gets_a_live_worker() -> None:
    # Before: the worker answered "out of memory" and exited, but went back to the pool still
    # alive for a moment, so the next caller's chat could find its pipe closed ("the template's
    # worker ended (exit 0)"): one worker makes the next render land on it every time.
    workers = TemplateWorkers(workers=1, time_limit_s=1.0)
    try:
        for _ in range(3):
            with pytest.raises(TemplateFailed, match="MiB of memory"):
                _render(workers, "{% set x = 'a' * 10**9 %}{{ x | length }}")
            assert _render(workers, CHATML).startswith("<|im_start|>user")
    finally:
        workers.close()


def test_a_template_that_runs_too_long_is_killed_and_its_worker_replaced(workers: TemplateWorkers) -> None:
    with pytest.raises(TemplateFailed, match="the template ran longer than 1 s"):
        _render(workers, LOOP)
    assert _render(workers, CHATML).startswith("<|im_start|>user")


def test_a_render_given_its_own_time_limit_gets_it_in_place_of_the_workers() -> None:
    # chat.py's end-of-turn probe at start: its first render also waits for a worker to start.
    nothing_answers = TemplateWorkers(workers=1, time_limit_s=0.0)
    try:
        with pytest.raises(TemplateFailed, match="the template ran longer than 0 s"):
            _render(nothing_answers, CHATML)
        text = nothing_answers.render(CHATML, MESSAGES, True, {}, time_limit_s=10.0)
        assert text == "<|im_start|>user\nhi<|im_end|>\n"
    finally:
        nothing_answers.close()


def test_output_past_the_bound_fails_while_it_is_produced(workers: TemplateWorkers) -> None:
    with pytest.raises(TemplateFailed, match=f"exceeds {MAX_RENDERED_CHARS} characters") as caught:
        _render(workers, "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}")
    assert caught.value.field == "chat"  # long messages can cause it as well as the template


def test_a_template_error_is_one_line_for_the_caller(workers: TemplateWorkers) -> None:
    with pytest.raises(TemplateFailed, match="the template failed: no way") as caught:
        _render(workers, "{{ raise_exception('no\nway') }}")
    assert caught.value.field == "chat.chat_template"
    with pytest.raises(TemplateFailed, match="the template does not compile: line 1: Expected an expression"):
        _render(workers, "{% if %}")


def test_compile_compiles_and_renders_nothing(workers: TemplateWorkers) -> None:
    workers.compile(CHATML)
    workers.compile("{{ raise_exception('rendered') }}")  # raises only when rendered
    with pytest.raises(TemplateFailed, match=r"^the template does not compile: line 2: unexpected '\)'$"):
        workers.compile("{% for m in messages %}\n{{ m['content'] ) }}\n{% endfor %}")
    with pytest.raises(
        TemplateFailed, match="^the template does not compile: line 1: No filter named 'nope'"
    ):
        workers.compile("{{ messages | nope }}")
    assert _render(workers, CHATML).startswith("<|im_start|>user")  # the worker serves on


def test_compiling_is_bounded_as_rendering_is(workers: TemplateWorkers) -> None:
    # Jinja folds constant expressions while compiling.
    with pytest.raises(TemplateFailed, match="the template ran longer than 1 s"):
        workers.compile("{{ 10 ** (10 ** 8) }}")
    with pytest.raises(TemplateFailed, match="the template ran longer than 1 s"):
        _render(workers, "{{ 10 ** (10 ** 8) }}")
    assert _render(workers, CHATML).startswith("<|im_start|>user")


def test_a_slow_template_does_not_hold_up_another_render(workers: TemplateWorkers) -> None:
    failed: list[Exception] = []

    def slow() -> None:
        try:
            _render(workers, LOOP)
        except TemplateFailed as e:
            failed.append(e)

    thread = threading.Thread(target=slow)
    thread.start()
    try:
        assert _render(workers, CHATML).startswith("<|im_start|>user")
        assert thread.is_alive()  # answered while the slow one still ran
    finally:
        thread.join(10)
    assert len(failed) == 1


def test_close_ends_every_worker(workers: TemplateWorkers) -> None:
    _render(workers, CHATML)
    processes = [w.process for w in workers._all]
    assert processes and all(p.poll() is None for p in processes)
    workers.close()
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(TemplateFailed, match="shut down"):
        _render(workers, CHATML)
