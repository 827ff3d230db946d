"""bf16 on XLA's CPU device parts from the float32 reference no earlier than the CPU bf16 engine does
(bench/fidelity.py's method: the first token that differs from the float32 greedy answer, per chat
question, summed over its five questions)."""

from __future__ import annotations

from pathlib import Path

from services.decoder.tests.engine.engine_helpers import run_concurrently
from tandem.common.torch_part.prompt_parts import TextPrompt
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tests.xla.helpers import engine_on

QUESTIONS = [  # bench/fidelity.py's
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
]
NUM_TOKENS = 32
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=80, num_kv_blocks=64, block_size=16)


def _answers(engine: Engine) -> list[list[int]]:
    specs = [
        GenerateSpec(
            [],
            SamplingParams(temperature=0.0),
            StoppingParams(NUM_TOKENS),
            chat=ChatRequest([ChatMessage("user", [TextPrompt(q)])]),
        )
        for q in QUESTIONS
    ]
    return [
        [t for e in events if isinstance(e, Delta) for t in e.token_ids]
        for events in run_concurrently(engine, specs)
    ]


def _first_divergences(reference: list[list[int]], answers: list[list[int]]) -> list[int]:
    return [
        next((i for i, (a, b) in enumerate(zip(r, t, strict=False)) if a != b), len(r))
        for r, t in zip(reference, answers, strict=True)
    ]


def test_bf16_on_xla_parts_from_float32_no_earlier_than_the_cpu_bf16_engine(smollm2_dir: Path) -> None:
    with engine_on("cpu", model_dir=smollm2_dir, dtype="float32", **LIMITS) as cpu:
        reference = _answers(cpu)
    with engine_on("cpu", model_dir=smollm2_dir, dtype="bfloat16", **LIMITS) as cpu:
        cpu_bf16 = _first_divergences(reference, _answers(cpu))
    xla_values = dict(LIMITS, seq_buckets=(8,), token_buckets=(32,), block_table_buckets=(5,))
    with engine_on("neuron", model_dir=smollm2_dir, dtype="bfloat16", **xla_values) as xla:
        xla_bf16 = _first_divergences(reference, _answers(xla))
        assert xla.core.runner.num_compiles_after_warmup == 0
    print(f"first divergences from float32: cpu bf16 {cpu_bf16}, xla bf16 {xla_bf16}")
    assert sum(xla_bf16) >= sum(cpu_bf16)
