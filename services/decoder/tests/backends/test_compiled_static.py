"""Compiled static-shape decoding on CPU: one graph per decode bucket, built at warmup, never again.

The workload test compiles with dynamo's "aot_eager" backend (the same captured graphs and guards as
Inductor, without generating C++), so it checks the no-recompile guarantee over many buckets fast;
one test runs real Inductor on one bucket (its C++ is what a cold CI cache pays for, kernel by kernel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.decoder.tests.engine.engine_helpers import finished, run_concurrently, tokens
from tandem.decoder.backends.backend import BACKENDS, Backend, RecompileError
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import LoadedModel

AOT_EAGER: Backend = dataclasses.replace(BACKENDS["cpu"], compiler="aot_eager")
# Two block-table widths, 2 and 8 blocks of 4: decode steps whose contexts all fit 8 positions take
# the narrow one. The workload's longest context is 16 prompt + 9 new positions.
STATIC = dict(
    static_shapes=True,
    max_num_seqs=6,
    max_num_batched_tokens=64,
    seq_buckets=(1, 8),
    max_model_len=32,
    block_table_buckets=(2, 8),
)


def _engine(model_dir: Path, loaded: LoadedModel, backend: Backend | None = None, **overrides) -> Engine:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=256, block_size=4)
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded, backend=backend)


def _random_workload(loaded: LoadedModel, num_requests: int, seed: int) -> list[GenerateSpec]:
    """Token-only, embedding-only and mixed prompts of random lengths; greedy and seeded sampling."""
    gen = torch.Generator().manual_seed(seed)
    hidden = loaded.config.hidden_size
    specs = []
    for i in range(num_requests):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        ids = torch.randint(5, 400, (n,), generator=gen).tolist()
        rows = EmbeddingPrompt(
            torch.randn(int(torch.randint(1, 5, (1,), generator=gen)), hidden, generator=gen)
        )
        prompt = ([ids], [rows], [ids, rows, ids[:1]])[i % 3]
        sampling = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.8, seed=i)
        max_new = int(torch.randint(2, 10, (1,), generator=gen))
        specs.append(GenerateSpec(prompt, sampling, StoppingParams(max_new_tokens=max_new, ignore_eos=True)))
    return specs


def _run_concurrently(engine: Engine, specs: list[GenerateSpec]) -> list[list[int]]:
    """Each spec's tokens, all submitted at once; every request must end Finished."""
    results = run_concurrently(engine, specs)
    for events in results:
        finished(events)  # asserts the last event is Finished, not Failed
    return [tokens(events) for events in results]


@pytest.fixture(scope="module")
def compiled_engine(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> Iterator[Engine]:
    """Four decode buckets (1 and 8 sequences, 2 widths) compiled at warmup; shared: warmup is slow."""
    with _engine(tiny_model_dir, tiny_fp32, AOT_EAGER, compile=True, **STATIC) as engine:
        yield engine


def test_compiled_decode_buckets_see_no_new_signature_or_compile_after_warmup_and_match_dynamic(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, compiled_engine: Engine
) -> None:
    specs = _random_workload(tiny_fp32, num_requests=12, seed=3)
    with _engine(tiny_model_dir, tiny_fp32, max_model_len=32) as engine:
        dynamic = _run_concurrently(engine, specs)
    runner = compiled_engine.core.runner
    compiler = runner.compiler
    assert compiler is not None
    warmed = set(runner.signatures)
    decode_buckets = {s for s in warmed if s.is_decode_only}
    assert set(runner.compiled_steps) == decode_buckets and len(decode_buckets) == 2 * 2
    assert {s.block_table_width for s in decode_buckets} == {2, 8}
    assert compiler.num_graphs == len(decode_buckets)  # fullgraph: exactly one graph per bucket
    calls_after_warmup = compiler.num_calls
    compiled = _run_concurrently(compiled_engine, specs)
    assert runner.signatures == warmed
    assert compiler.num_graphs == len(decode_buckets)
    assert compiler.num_calls > calls_after_warmup  # decode steps really ran the compiled graphs
    assert compiled == dynamic


def test_a_decode_bucket_not_compiled_at_warmup_fails_loudly(compiled_engine: Engine) -> None:
    with pytest.raises(RecompileError, match="was not compiled at warmup"):
        compiled_engine.core.runner.warmup(3, 3)  # 3 sequences is no bucket: only a padding bug makes it


def test_a_changed_guard_after_warmup_raises_instead_of_recompiling(
    tiny_fp32: LoadedModel, compiled_engine: Engine
) -> None:
    runner = compiled_engine.core.runner
    assert runner.compiler is not None
    step = runner.compiler.bucket()
    attn = _decode_metadata(runner, 8)
    ids, embeds = torch.zeros(8, dtype=torch.int32), torch.zeros(8, tiny_fp32.config.hidden_size)
    is_token = torch.ones(8, dtype=torch.bool)
    # A warmed-up bucket's shapes, but int32 positions instead of int64: dynamo's guards fail.
    with pytest.raises(Exception, match="recompil"), torch.inference_mode():
        step(ForwardBatch(ids, torch.zeros(8, dtype=torch.int32), attn, embeds, is_token), runner.kv_caches)
    assert runner.compiler.num_graphs == 2 * 2


def _decode_metadata(runner, num_seqs: int):
    from tandem.decoder.models.attention import AttentionMetadata

    assert runner.static is not None
    width = runner.static.block_table_widths[-1]
    return AttentionMetadata(
        query_lens=[1] * num_seqs,
        seq_lens=[1] * num_seqs,
        seq_lens_t=torch.ones(num_seqs, dtype=torch.int32),
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
        block_tables=torch.zeros(num_seqs, width, dtype=torch.int32),
        logits_indices=torch.arange(num_seqs, dtype=torch.int64),
    )


def test_inductor_compiled_decode_gives_the_eager_tokens(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    specs = _random_workload(tiny_fp32, num_requests=3, seed=5)
    # One decode bucket, two rows: each decode step is the request's row beside a padding row, so the
    # generated kernels see padding too. Every graph is about six C++ kernels, each a g++ run of a few
    # seconds with a cold cache; the many-bucket guarantees are the aot_eager tests' above.
    small = dict(
        static_shapes=True,
        max_num_seqs=1,
        max_num_batched_tokens=32,
        seq_buckets=(2,),
        block_table_buckets=(32,),
    )
    with _engine(tiny_model_dir, tiny_fp32, max_model_len=128, **small) as engine:
        eager = [_run_concurrently(engine, [spec])[0] for spec in specs]
    with _engine(tiny_model_dir, tiny_fp32, compile=True, max_model_len=128, **small) as engine:
        compiler = engine.core.runner.compiler
        assert compiler is not None and compiler.num_graphs == 1
        calls_after_warmup = compiler.num_calls
        compiled = [_run_concurrently(engine, [spec])[0] for spec in specs]
        assert compiler.num_graphs == 1
        assert compiler.num_calls > calls_after_warmup  # the decode steps ran the Inductor graph
    assert compiled == eager


def test_a_decode_shaped_step_that_scores_a_prompt_position_runs_eagerly(compiled_engine: Engine) -> None:
    # One position of a prompt that scores itself: a decode bucket's shape (1 token, 1 sequence), but
    # one logits row more than the bucket was compiled for. It must not ask for a graph after warmup.
    from tandem.decoder.engine.request import Request, TokenSegment
    from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan

    core = compiled_engine.core
    request = Request.from_segments("scoring", [TokenSegment([5, 6, 7])], SamplingParams(prompt_logprobs=2))
    with core.lock:
        assert core.block_manager.allocate_slots(request, 1)
    try:
        item = ScheduledRequest("scoring", request, 0, 1, tuple(request.block_ids), False, True)
        plan = StepPlan((item,), 1, (), 0)
        output = core.runner.execute(plan)  # one rank: the head a slice of rows at a time
        logits = core.runner.forward(core.runner.prepare(plan))  # what the other ranks of several run
    finally:
        with core.lock:
            core.block_manager.free(request)
    assert output.logits.shape[0] == 0
    (chunk,) = output.prompt_logprobs
    assert chunk.start == 1 and len(chunk.logprobs) == 1 and len(chunk.top_token_ids[0]) == 2
    assert logits.shape[0] == 2  # the bucket's one (padding) sampling row, then the scored row
    assert chunk.logprobs[0] == pytest.approx(torch.log_softmax(logits[1], -1)[6].item(), abs=1e-5)
    assert core.runner.compiler is not None and core.runner.compiler.num_graphs == 2 * 2
