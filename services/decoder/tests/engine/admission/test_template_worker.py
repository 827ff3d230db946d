"""Template workers: a chat template renders in a process of its own, bounded in memory, time and
output; a template past a bound fails alone, its worker is replaced, and others keep rendering. A
render is judged by its template's time alone, never by a worker's start."""

from __future__ import annotations

import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import psutil
import pytest

from tandem.decoder.engine.admission.template_worker import (
    MAX_RENDERED_CHARS,
    TemplateFailed,
    TemplateWorkers,
    TemplateWorkerUnavailable,
    spawn_worker,
)

MESSAGES = [{"role": "user", "content": "hi"}]
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# Runs 10^10 empty iterations: nothing printed, so only a time bound ends it.
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
OUT_OF_MEMORY = "{% set x = 'a' * 10**9 %}{{ x | length }}"


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


def test_strftime_now_prints_the_time_now_as_transformers_does(workers: TemplateWorkers) -> None:
    # Llama 3.1's own lines: "Today Date: 26 Jul 2024" was printed where transformers prints today's.
    source = (
        '{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}'
        '{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}Today Date: {{ date_string }}'
    )
    before = datetime.now().strftime("%d %b %Y")
    printed = _render(workers, source)
    assert printed in {f"Today Date: {before}", f"Today Date: {datetime.now().strftime('%d %b %Y')}"}


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


Spawn = Callable[[int], subprocess.Popen[bytes]]


def _recorded(started: list[subprocess.Popen[bytes]], start_delay_s: float = 0.0) -> Spawn:
    """Starts workers as the pool does, each `start_delay_s` slower to say it is ready (a busy
    machine's start), and records their processes in `started`."""

    def spawn(memory_bytes: int) -> subprocess.Popen[bytes]:
        if start_delay_s:
            main = "from tandem.decoder.engine.admission.template_worker_main import main"
            process = subprocess.Popen(
                [sys.executable, "-P", "-c", f"import time; time.sleep({start_delay_s}); {main}; main()"]
                + [str(memory_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        else:
            process = spawn_worker(memory_bytes)
        started.append(process)
        return process

    return spawn


def _has_said_something(process: subprocess.Popen[bytes], within_s: float) -> bool:
    """Whether the worker wrote a line (its ready line) within `within_s`, none of it read."""
    assert process.stdout is not None
    return bool(select.select([process.stdout.fileno()], [], [], within_s)[0])


def test_workers_slow_to_start_do_not_fail_the_first_concurrent_renders() -> None:
    # Before: a render's 1 s counted its worker's start too, so on a busy machine (each start here
    # 1.5 s) the first chats, or the first after a worker was replaced, failed naming the template.
    started: list[subprocess.Popen[bytes]] = []
    workers = TemplateWorkers(time_limit_s=1.0, spawn=_recorded(started, start_delay_s=1.5))
    texts: list[str] = []
    failed: list[Exception] = []

    def chat() -> None:
        try:
            texts.append(_render(workers, CHATML))
        except Exception as error:
            failed.append(error)

    threads = [threading.Thread(target=chat) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert failed == []
        assert texts == ["<|im_start|>user\nhi<|im_end|>\n"] * 2
        assert len(started) == 2  # both cold workers served, none replaced
    finally:
        workers.close()


@pytest.mark.parametrize(("source", "why"), [(LOOP, "ran longer than 1 s"), (OUT_OF_MEMORY, "MiB of memory")])
def test_a_killed_workers_successor_starts_at_once_and_is_ready_before_the_next_request(
    source: str, why: str
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    workers = TemplateWorkers(workers=1, time_limit_s=1.0, spawn=_recorded(started))
    try:
        with pytest.raises(TemplateFailed, match=why):
            _render(workers, source)
        first, successor = started  # started when the first ended, no request asking for it
        assert first.poll() is not None
        assert _has_said_something(successor, within_s=10.0)  # ready, no request asking
        assert _render(workers, CHATML).startswith("<|im_start|>user")
        assert started == [first, successor] and successor.poll() is None  # it took the render
    finally:
        workers.close()


def test_a_hostile_template_is_still_cut_at_its_limit_once_its_worker_has_started() -> None:
    started: list[subprocess.Popen[bytes]] = []
    workers = TemplateWorkers(workers=1, time_limit_s=1.0, spawn=_recorded(started, start_delay_s=1.5))
    try:
        assert _render(workers, CHATML).startswith("<|im_start|>user")  # waits for the start
        begun = time.monotonic()
        with pytest.raises(TemplateFailed, match="the template ran longer than 1 s"):
            _render(workers, LOOP)
        assert 1.0 <= time.monotonic() - begun < 1.8
        # On a worker still starting the wait is its start and then the limit, never more.
        begun = time.monotonic()
        with pytest.raises(TemplateFailed, match="the template ran longer than 1 s"):
            _render(workers, LOOP)
        assert 1.0 <= time.monotonic() - begun < workers.start_limit_s + workers.time_limit_s
    finally:
        workers.close()


def test_a_worker_that_does_not_start_in_time_is_unavailable_not_the_templates_fault() -> None:
    started: list[subprocess.Popen[bytes]] = []
    workers = TemplateWorkers(
        workers=1, time_limit_s=1.0, start_limit_s=0.3, spawn=_recorded(started, start_delay_s=30)
    )
    try:
        begun = time.monotonic()
        with pytest.raises(TemplateWorkerUnavailable, match="did not start within 0.3 s"):
            _render(workers, CHATML)
        assert time.monotonic() - begun < 1.5
        first, successor = started
        assert first.poll() is not None and successor.poll() is None  # killed, and replaced at once
    finally:
        workers.close()


def test_close_leaves_no_child_process_or_thread() -> None:
    threads = threading.active_count()
    started: list[subprocess.Popen[bytes]] = []
    workers = TemplateWorkers(time_limit_s=1.0, spawn=_recorded(started, start_delay_s=0.5))
    with pytest.raises(TemplateFailed, match="ran longer"):
        _render(workers, LOOP)  # its worker killed and a successor starting: three in all
    workers.close()
    assert len(started) == 3 and all(p.returncode is not None for p in started)  # each reaped
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    assert children.isdisjoint(p.pid for p in started)
    assert threading.active_count() == threads


def test_the_worker_imports_no_torch_numpy_or_grpc() -> None:
    """The worker runs under a 512 MiB address-space limit set before Jinja2 loads: its module (started
    with -m) and the package it sits in must stay standard-library and Jinja2 only (about 21 MB at its
    ready line). Nothing held it to that: torch alone reserves more than the limit."""
    module = "tandem.decoder.engine.admission.template_worker_main"
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'numpy', 'grpc') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
