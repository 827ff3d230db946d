"""Work run on a thread of a deep stack of its own, as llguidance's compiling needs."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from tandem.decoder.engine.sampling.deep_stack import on_deep_stack


def test_the_work_runs_on_a_thread_of_its_own_and_its_result_comes_back() -> None:
    assert on_deep_stack(lambda: threading.current_thread().name) == "tandem-grammar-compile"


def test_the_works_exception_is_raised_to_its_caller() -> None:
    # Run from a thread of the test's, so that an exception the deep thread kept would fail the test
    # at the timeout rather than hang it.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def refuse() -> None:
        raise ValueError("refused on the deep stack")

    calling = pool.submit(on_deep_stack, refuse)
    pool.shutdown(wait=False)
    with pytest.raises(ValueError, match="refused on the deep stack"):
        calling.result(timeout=30)


def test_the_process_wide_stack_size_is_given_back_for_every_other_thread() -> None:
    # threading.stack_size sets the size of every thread started after it, the engine's included.
    previous = threading.stack_size()
    assert on_deep_stack(lambda: 1, stack_bytes=2 * 1024 * 1024) == 1
    assert threading.stack_size() == previous
