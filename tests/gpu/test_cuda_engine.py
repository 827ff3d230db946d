"""The engine on CUDA against the same engine on CPU in float32 (run by scripts/device_check.sh).

On the default model (SmolLM2-135M-Instruct) and bench-small, with a token prompt, an embedding prompt
(rows of the model's own embedding table) and a mixed one, submitted together so every step batches
ragged sequences: the CUDA engine's greedy tokens equal the CPU engine's, eager (FlexAttention compiled
on its own) and with every decode bucket captured as a CUDA graph at warmup.
"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24
SETTINGS = dict(dtype="float32", block_size=16, num_kv_blocks=256, max_num_seqs=3, max_model_len=128)
# Decode buckets of 1 and 4 sequences, each at one or two block-table widths (2 and 8 blocks of 16).
GRAPHS = dict(static_shapes=True, compile=True, max_num_batched_tokens=64, seq_buckets=(1, 4))
WIDTHS = {"default": (8,), "bench-small": (2, 8)}  # the 30-layer model compiles fewer graphs
TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module", params=["default", "bench-small"])
def model_dir(request: pytest.FixtureRequest) -> tuple[str, Path]:
    fixture = "default_model_fp32" if request.param == "default" else "bench_small_dir"
    return request.param, request.getfixturevalue(fixture)


@pytest.fixture(scope="module")
def cpu_run(model_dir: tuple[str, Path]) -> tuple[list[GenerateSpec], list[list[int]]]:
    """The specs (embedding rows read off the CPU model) and the CPU float32 engine's tokens."""
    with Engine(EngineConfig(model_dir=model_dir[1], **SETTINGS)) as engine:
        ids = engine.tokenizer.encode(TEXT).ids[:12]
        table = engine.loaded.model.embed_tokens.weight
        rows = EmbeddingPrompt(table[torch.tensor(ids[:6])].detach().clone())
        greedy, stopping = (
            SamplingParams(temperature=0.0),
            StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        )
        prompts = [[ids], [rows], [ids[:3], rows, ids[6:9]]]
        specs = [GenerateSpec(prompt, greedy, stopping) for prompt in prompts]
        return specs, _tokens(engine, specs)


def _tokens(engine: Engine, specs: list[GenerateSpec]) -> list[list[int]]:
    """All specs submitted at once; each one's tokens."""
    queues: list[queue.SimpleQueue[Event]] = [queue.SimpleQueue() for _ in specs]
    for spec, events in zip(specs, queues, strict=True):
        engine.submit(spec, events.put)
    out = []
    for events in queues:
        tokens: list[int] = []
        while not isinstance(event := events.get(timeout=600), Finished | Failed):
            tokens += event.token_ids if isinstance(event, Delta) else []
        assert isinstance(event, Finished), event
        out.append(tokens)
    return out


def test_the_cuda_engine_gives_the_cpu_float32_tokens(
    model_dir: tuple[str, Path], cpu_run: tuple[list[GenerateSpec], list[list[int]]]
) -> None:
    specs, expected = cpu_run
    with Engine(EngineConfig(model_dir=model_dir[1], device="cuda", **SETTINGS)) as engine:
        assert engine.loaded.model.embed_tokens.weight.is_cuda
        assert all(len(tokens) == NEW_TOKENS for tokens in expected)
        assert _tokens(engine, specs) == expected


def test_cuda_graph_decode_buckets_give_the_cpu_float32_tokens_and_compile_only_at_warmup(
    model_dir: tuple[str, Path], cpu_run: tuple[list[GenerateSpec], list[list[int]]]
) -> None:
    specs, expected = cpu_run
    name, path = model_dir
    config = EngineConfig(
        model_dir=path, device="cuda", **SETTINGS, **GRAPHS, block_table_buckets=WIDTHS[name]
    )
    with Engine(config) as engine:
        runner = engine.core.runner
        assert runner.compiler is not None
        warmed, num_graphs = set(runner.signatures), runner.compiler.num_graphs
        assert num_graphs == 2 * len(WIDTHS[name])  # one CUDA graph per decode bucket
        calls = runner.compiler.num_calls
        assert _tokens(engine, specs) == expected
        assert runner.signatures == warmed and runner.compiler.num_graphs == num_graphs
        assert runner.compiler.num_calls > calls  # decode steps replayed the graphs
