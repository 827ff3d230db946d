"""A model that produces NaN or infinity for one request ends that request alone (step/non_finite.py).

The tiny model never does, so a hook around the runner makes one request's logits non-finite at one
output position (or, for prompt_logprobs, the head's output at one scored row), as float16 overflow
or a bad checkpoint would. The faulty request must end with ModelFault naming the position, after
exactly the tokens it had before it, its KV blocks free; every neighbour must get the tokens it gets
in a run without the faulty request; the engine must go on serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.decoder.tests.engine.engine_helpers import finished, run_concurrently, tokens
from services.decoder.tests.engine.front.test_engine_speculation import Oracle, oracle  # noqa: F401
from tandem.client.errors import ModelFault
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Event, Failed
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.scheduling.step_plan import StepPlan
from tandem.decoder.engine.step.runner import StepOutput
from tandem.decoder.models.loader import LoadedModel

BAD_PROMPT = [17, 4, 250, 91, 33, 7, 120, 5]
NAN = float("nan")


def _engine(model_dir: Path, loaded: LoadedModel, **overrides) -> Engine:
    settings = dict(
        model_dir=model_dir,
        dtype="float32",
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=8,
        enable_prefix_caching=False,  # every block is free again once every request has ended
    )
    return Engine(EngineConfig(**(settings | overrides)), loaded)


def _spec(prompt: list[int], sampling: SamplingParams, request_id: str, **kw) -> GenerateSpec:
    stopping = StoppingParams(max_new_tokens=10, ignore_eos=kw.pop("ignore_eos", True))
    return GenerateSpec([prompt], sampling, stopping, request_id=request_id, **kw)


def _neighbours() -> list[GenerateSpec]:
    return [
        _spec([3, 9, 27, 81, 243], SamplingParams(temperature=0.0), "greedy"),
        _spec([11, 22, 33], SamplingParams(temperature=0.9, top_k=50, seed=5, logprobs=True), "seeded"),
        _spec(list(range(40, 60)), SamplingParams(temperature=0.0, top_logprobs=2), "long"),
    ]


def _poison(engine: Engine, position: int, row: Callable[[torch.Tensor], None]) -> list[int]:
    """From now on the logits that sample BAD_PROMPT's output token `position` go through `row`
    (which makes them non-finite in place). Returns the list of the rows' `ahead` (0 = the request's
    next token, j = after j proposed ones), one entry each time it struck."""
    runner = engine.core.runner
    execute = runner.execute
    struck: list[int] = []

    def poisoned(plan: StepPlan) -> StepOutput:
        output = execute(plan)
        logits = output.logits.clone()  # [num_sampled_rows, vocab]; the runner's is an inference tensor
        first = 0
        for item in (i for i in plan.scheduled if i.needs_logits):
            ahead = position - item.request.num_output_tokens
            if item.request.prompt_token_ids == BAD_PROMPT and 0 <= ahead <= item.num_draft_tokens:
                row(logits[first + ahead])
                struck.append(ahead)
            first += 1 + item.num_draft_tokens
        return dataclasses.replace(output, logits=logits)

    runner.execute = poisoned
    return struck


def _nan_at(token: int) -> Callable[[torch.Tensor], None]:
    def row(logits: torch.Tensor) -> None:
        logits[token] = NAN

    return row


def _all(value: float) -> Callable[[torch.Tensor], None]:
    return lambda logits: logits.fill_(value)


def _assert_failed_at(events: list[Event], where: str) -> None:
    assert isinstance(events[-1], Failed), events[-1]
    error = events[-1].error
    assert isinstance(error, ModelFault) and where in error.message, error.message
    assert "non-finite logits" in error.message


@pytest.mark.parametrize(
    "row",
    [_nan_at(0), _nan_at(500), _all(NAN), _all(float("-inf")), _all(float("inf"))],
    ids=["nan-at-0", "nan-at-500", "all-nan", "all-minus-inf", "all-inf"],
)
def test_non_finite_logits_end_that_request_alone_and_its_neighbours_stream_on_unchanged(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, row: Callable[[torch.Tensor], None]
) -> None:
    bad = _spec(BAD_PROMPT, SamplingParams(temperature=0.0), "bad")
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        clean = tokens(engine.generate(bad))
        without = [tokens(events) for events in run_concurrently(engine, _neighbours())]

        initial = engine.core.block_manager.num_free_blocks
        struck = _poison(engine, 4, row)
        *together, faulty = run_concurrently(engine, [*_neighbours(), bad])
        assert struck == [0]
        assert engine.core.block_manager.num_free_blocks == initial
        assert engine.core.num_live() == 0
        after = tokens(engine.generate(_neighbours()[0]))  # the engine still serves

    assert [tokens(events) for events in together] == without
    assert all(finished(events).output_tokens == 10 for events in together)
    _assert_failed_at(faulty, "output position 4")
    assert tokens(faulty) == clean[:4]
    assert after == without[0]


def test_a_constrained_request_whose_logits_turn_nan_ends_without_a_token_its_grammar_forbids(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """Softmax of a NaN row is NaN throughout, whose sample is token 0 (the first maximum): a token
    the grammar forbids. The request ends with the model's fault, not the grammar's."""
    choices = StructuredOutput("choice", ("red", "green", "blue"))
    sampling = SamplingParams(temperature=0.9, seed=3)
    bad = _spec(BAD_PROMPT, sampling, "bad", structured=choices, ignore_eos=False)
    neighbour = _spec([5, 6, 7], sampling, "neighbour", structured=choices, ignore_eos=False)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        (without,) = run_concurrently(engine, [neighbour])
        _poison(engine, 0, _all(NAN))
        together, faulty = run_concurrently(engine, [neighbour, bad])
        assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_total_blocks
    _assert_failed_at(faulty, "output position 0")
    assert tokens(faulty) == []
    assert tokens(together) == tokens(without)


def test_a_speculating_request_ends_where_a_plain_one_does_with_the_tokens_before(
    tiny_model_dir: Path,
    tiny_fp32: LoadedModel,
    oracle: Oracle,  # noqa: F811
) -> None:
    """Its fault falls on a row verifying a proposal (ahead > 0): the accepted tokens before it are
    sent, the request ends at the same output position and with the same tokens as without proposals."""
    bad = _spec(BAD_PROMPT, SamplingParams(temperature=0.0), "bad")
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        oracle.know(BAD_PROMPT, tokens(engine.generate(bad)))
        _poison(engine, 3, _nan_at(9))
        plain = list(engine.generate(bad))
    with _engine(tiny_model_dir, tiny_fp32, speculative_tokens=4) as engine:
        struck = _poison(engine, 3, _nan_at(9))
        speculating = list(engine.generate(bad))
        assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_total_blocks
    assert struck and struck[0] > 0  # a verifying row, not the request's next token
    _assert_failed_at(plain, "output position 3")
    _assert_failed_at(speculating, "output position 3")
    assert tokens(speculating) == tokens(plain) and len(tokens(plain)) == 3


def test_prompt_logprobs_from_non_finite_logits_end_the_request_naming_the_prompt_position(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = _spec(BAD_PROMPT, SamplingParams(temperature=0.0, prompt_logprobs=2), "bad")
    neighbours = _neighbours()
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        without = [tokens(events) for events in run_concurrently(engine, neighbours)]
        executor = engine.core.runner.executor
        compute_logits = executor.compute_logits

        def poisoned(h: torch.Tensor, *args) -> torch.Tensor:
            logits = compute_logits(h, *args).clone()  # [rows, vocab]
            if h.shape[0] == len(BAD_PROMPT) - 1:  # the scored rows: positions 0 .. 6 score 1 .. 7
                logits[4, 2] = NAN  # position 4's logits, which score prompt position 5
            return logits

        monkeypatch.setattr(executor, "compute_logits", poisoned)
        *together, faulty = run_concurrently(engine, [*neighbours, bad])
        assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_total_blocks
    _assert_failed_at(faulty, "prompt position 5")
    assert tokens(faulty) == []
    assert [tokens(events) for events in together] == without
