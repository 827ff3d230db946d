"""--batch-invariant: on the default model in bf16, a request's tokens and logprobs are the same alone,
in any batch and run again, seeded sampling and greedy alike, prefill chunked or not.

Without the mode a request's logits can round differently with its batch (the matrix kernels pick
their blocking by the number of rows, and prefill chunks follow the step's shared token budget), so
this compares, bit for bit, what the mode promises: the same request run alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event
from tandem.decoder.engine.params import SamplingParams, StoppingParams

from .test_engine import _run_concurrently


def _specs() -> list[GenerateSpec]:
    prompts = [
        "Once upon a time",
        "The capital of France is",
        "List three colours and say why you like each of them, one sentence per colour, please:",
        "def fibonacci(n):",
    ]
    samplings = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.8, seed=9, logprobs=True),
        SamplingParams(temperature=0.8, seed=10, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    stopping = StoppingParams(max_new_tokens=12, ignore_eos=True)
    return [
        GenerateSpec([TextPrompt(p)], s, stopping, request_id=f"r{i}")
        for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
    ]


def _output(events: list[Event]) -> tuple[list[int], list[float]]:
    deltas = [e for e in events if isinstance(e, Delta)]
    return [t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs]


@pytest.mark.timeout(600)
def test_batch_invariant_mode_gives_each_request_its_alone_tokens_and_logprobs_in_bf16(
    smollm2_dir: Path,
) -> None:
    specs = _specs()
    # A budget of 16 chunks the long prompt (about 20 positions) alone and in the batch alike; a long-
    # prefill threshold, which would cut its chunks only beside decodes, is not applied.
    config = EngineConfig(
        model_dir=smollm2_dir,
        dtype="bfloat16",
        max_num_batched_tokens=16,
        batch_invariant=True,
        long_prefill_token_threshold=4,
    )
    with Engine(config) as engine:
        alone = [_output(list(engine.generate(spec))) for spec in specs]
        together = [_output(events) for events in _run_concurrently(engine, specs)]
        pairs = [_output(events) for events in _run_concurrently(engine, specs[1:3])]
        again = [_output(list(engine.generate(spec))) for spec in specs]
    assert again == alone  # the same request, later: what a prefix-cache hit would have changed
    assert together == alone
    assert pairs == alone[1:3]
    assert all(len(tokens) == 12 for tokens, _ in alone)
