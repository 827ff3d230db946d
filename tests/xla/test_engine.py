"""An engine on the XLA device: every bucket compiled at warmup, and nothing compiled after it, whatever
mix of requests the scheduler makes of a workload; the CPU engine's tokens; the limits refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from services.decoder.tests.engine.engine_helpers import run_concurrently
from tandem.client.errors import InvalidArgument
from tandem.common.torch_part.prompt_parts import EmbeddingPrompt, PromptPart
from tandem.decoder.backends.backend import RecompileError
from tandem.decoder.backends.xla import runtime
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.scheduling.step_plan import StepPlan
from tandem.decoder.engine.step.runner import StepOutput
from tandem.decoder.engine.step.xla_runner import XlaRunner
from tests.xla.helpers import engine_on, greedy, settings, table_rows

# 8 at once, prefill chunks of up to 32 positions, speculation's verify rows in decode graphs of 16.
WORKLOAD = dict(
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=128,
    seq_buckets=(4, 16),
    token_buckets=(8, 32),
    block_table_buckets=(2, 8),
    speculative_max_batch=4,
)
LENGTHS = [1, 2, 5, 8, 9, 17, 31, 32, 33, 60, 90]  # 1 .. the largest bucket, and longer: chunked


def _workload(model_dir: Path, vocab_size: int) -> list[GenerateSpec]:
    """50 requests of every prompt kind and length, some speculating, some scoring their prompt, one
    structured."""
    specs = []
    for i in range(50):
        length = LENGTHS[i % len(LENGTHS)]
        # A repeating pattern, so prompt lookup has proposals to verify.
        ids = [(7 * (j % 5) + i) % (vocab_size - 2) + 1 for j in range(length)]
        kind = i % 3
        prompt: list[PromptPart]
        if kind == 0 or length < 3:
            prompt = [ids]
        elif kind == 1:
            prompt = [EmbeddingPrompt(table_rows(model_dir, ids, seed=i))]
        else:
            prompt = [ids[:2], EmbeddingPrompt(table_rows(model_dir, ids[2:-1], seed=i)), ids[-1:]]
        specs.append(
            GenerateSpec(
                prompt,
                SamplingParams(temperature=0.0, prompt_logprobs=2 if i % 7 == 3 else None),
                StoppingParams(max_new_tokens=1 + i % 12, ignore_eos=i != 20),
                speculative_tokens=3 if i % 4 == 1 else 0,
                structured=StructuredOutput("choice", ("yes", "no")) if i == 20 else None,
            )
        )
    return specs


def _tokens(events: list[Event]) -> list[int]:
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def _prompt_logprobs(events: list[Event]) -> list[float | None]:
    return [p.logprob for e in events if isinstance(e, Delta) for p in e.prompt_logprobs]


def test_a_workload_of_every_request_kind_compiles_nothing_after_warmup_and_gives_the_cpu_tokens(
    tiny_model_dir: Path,
) -> None:
    values = settings(tiny_model_dir, **WORKLOAD)
    with engine_on("cpu", **values) as cpu:
        specs = _workload(tiny_model_dir, cpu.model_config.vocab_size)
        want = run_concurrently(cpu, specs)
    with engine_on("neuron", **values) as xla:
        runner = xla.core.runner
        assert isinstance(runner, XlaRunner)
        compiled = runtime.num_compiles()
        assert compiled >= len(runner.buckets.all())  # every bucket at warmup, and the LM head
        got: list[list[Event]] = []
        sizes = itertools.cycle([1, 3, 8, 2, 5, 4, 7, 6])  # 1-8 requests at once
        start = 0
        while start < len(specs):
            size = next(sizes)
            got += run_concurrently(xla, specs[start : start + size])
            start += size
        # A cancel: a long generation left after its first tokens frees its blocks at the next step.
        stream = xla.generate(GenerateSpec([[3, 4, 5]], SamplingParams(temperature=0.0), StoppingParams(100)))
        assert any(isinstance(e, Delta) for e in itertools.islice(stream, 3))
        stream.close()
        assert greedy(xla, [[9, 8, 7]], num_tokens=4)  # the next request runs, after the abort
        assert runtime.num_compiles() == compiled
        assert runner.num_compiles_after_warmup == 0
        assert xla.core.block_manager.num_used_blocks == 0
        assert xla.core.num_proposed_tokens > 0  # speculation ran: verify rows in decode graphs
    for spec, expected, events in zip(specs, want, got, strict=True):
        assert _tokens(events) == _tokens(expected)
        if spec.sampling.prompt_logprobs is not None:
            scored, reference = _prompt_logprobs(events), _prompt_logprobs(expected)
            assert len(scored) == len(reference) == sum(map(_num_positions, spec.prompt))
            for a, b in zip(scored, reference, strict=True):
                assert (a is None and b is None) or abs(a - b) < 1e-4


def _num_positions(part: PromptPart) -> int:
    return part.rows.shape[0] if isinstance(part, EmbeddingPrompt) else len(part)  # type: ignore[arg-type]


def test_a_prompt_past_the_context_the_buckets_hold_is_refused_naming_the_limit(tiny_model_dir: Path) -> None:
    with engine_on("neuron", **settings(tiny_model_dir, **WORKLOAD)) as xla:
        with pytest.raises(InvalidArgument, match="max_model_len 128"):
            xla.make_request(GenerateSpec([list(range(1, 130))], stopping=StoppingParams(max_new_tokens=1)))
        # Within it, a long prompt is chunked into the prefill buckets, not refused.
        assert len(greedy(xla, [[(7 * j) % 1000 + 1 for j in range(100)]], num_tokens=8)) == 8
        assert xla.core.runner.num_compiles_after_warmup == 0


def test_the_kv_cache_and_weights_live_on_the_xla_device(tiny_model_dir: Path) -> None:
    with engine_on("neuron", **settings(tiny_model_dir, max_num_seqs=2, seq_buckets=(2,))) as xla:
        runner: XlaRunner = xla.core.runner  # type: ignore[assignment]
        assert {cache.device.type for cache in runner.kv_caches} == {"xla"}
        assert {p.device.type for p in xla.loaded.model.parameters()} == {"xla"}
        assert runner.device == torch.device("cpu")  # batches are built and sampled on the host


def test_a_bucket_not_warmed_up_fails_the_step_loudly_before_anything_compiles(tiny_model_dir: Path) -> None:
    # Never compiled on the fly in the middle of serving: the engine fails instead, and says why.
    with engine_on("neuron", **settings(tiny_model_dir, max_num_seqs=2, seq_buckets=(2,))) as xla:
        runner: XlaRunner = xla.core.runner  # type: ignore[assignment]
        runner.warmed = {b for b in runner.warmed if not b.is_decode}
        compiled = runtime.num_compiles()
        events = list(
            xla.generate(GenerateSpec([[1, 2]], SamplingParams(temperature=0.0), StoppingParams(4)))
        )
        assert isinstance(events[-1], Failed) and "RecompileError" in str(events[-1].error)
        assert isinstance(xla._thread.error, RecompileError)
        assert "was not compiled at warmup" in str(xla._thread.error)
        assert runtime.num_compiles() == compiled


def test_a_prefill_chunk_capped_beside_a_decode_fills_a_prefill_bucket(tiny_model_dir: Path) -> None:
    """Each prefill chunk runs as a graph of its own, padded up to a prefill bucket (8 or 32 positions
    here): capped at the threshold less the decode row, 15 positions ran in the 32-position graph, as
    dear as an uncapped chunk for half its positions. It takes the largest bucket within the threshold."""
    values = settings(tiny_model_dir, long_prefill_token_threshold=16, enable_prefix_caching=False)
    long_prompt = [(7 * j) % 1000 + 1 for j in range(90)]
    capped: list[int] = []  # positions of each prefill chunk beside a decode

    def spec(prompt: list[int], num_tokens: int) -> GenerateSpec:
        stopping = StoppingParams(num_tokens, ignore_eos=True)
        return GenerateSpec([prompt], SamplingParams(temperature=0.0), stopping)

    with engine_on("neuron", **values) as xla:
        alone = greedy(xla, [long_prompt], num_tokens=4)
        runner = xla.core.runner
        execute = runner.execute

        def recorded(plan: StepPlan) -> StepOutput:
            if not all(item.is_prefill for item in plan.scheduled):
                capped.extend(item.num_new_tokens for item in plan.scheduled if item.is_prefill)
            return execute(plan)

        runner.execute = recorded  # type: ignore[method-assign]
        # Both prefill in the first step; then the neighbour decodes beside the long prompt's chunks.
        _, beside = run_concurrently(xla, [spec([3, 4, 5], 12), spec(long_prompt, 4)])
        assert runner.num_compiles_after_warmup == 0
    assert capped == [8] * 7 + [5]  # the 61 positions left after the first 29
    assert _tokens(beside) == alone


def _token_logprobs(events: list[Event]) -> list[tuple[int, str]]:
    deltas = [e for e in events if isinstance(e, Delta)]
    return [(t, repr(lp)) for d in deltas for t, lp in zip(d.token_ids, d.logprobs, strict=True)]


def test_batch_invariant_runs_each_request_alone_so_neighbours_and_speculation_change_no_bit(
    tiny_model_dir: Path,
) -> None:
    """--batch-invariant on XLA runs each request in graphs of its own (XLA's kernels block as they
    choose; on XLA's CPU device they happen not to, so the bits alone do not tell the modes apart,
    and each graph's requests are counted too): in bf16, a request's logprobs are the same bits alone,
    beside neighbours being prefilled in chunks and decoding, and speculating (its verify rows in a
    decode graph of 4) or not."""
    values = settings(tiny_model_dir, dtype="bfloat16", batch_invariant=True, speculative_max_batch=4)
    requests_per_graph: list[int] = []

    def spec(ids: list[int], max_new_tokens: int = 10, speculative_tokens: int = 0) -> GenerateSpec:
        sampling = SamplingParams(temperature=0.0, logprobs=True)
        stopping = StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        return GenerateSpec([ids], sampling, stopping, speculative_tokens=speculative_tokens)

    target = [7 * (j % 5) + 1 for j in range(20)]  # repeating: prompt lookup has proposals
    neighbours = [spec([(3 * j + i) % 400 + 2 for j in range(5 + 13 * i)], 3 + i) for i in range(3)]
    with engine_on("neuron", **values) as xla:
        runner = xla.core.runner
        execute = runner._execute

        def counted(plan: StepPlan) -> StepOutput:
            requests_per_graph.append(len(plan.scheduled))
            return execute(plan)

        runner._execute = counted  # type: ignore[method-assign]
        alone = _token_logprobs(run_concurrently(xla, [spec(target)])[0])
        beside = _token_logprobs(run_concurrently(xla, [spec(target), *neighbours])[0])
        speculating = [
            _token_logprobs(run_concurrently(xla, [spec(target, speculative_tokens=3), *others])[0])
            for others in ([], neighbours)
        ]
        assert xla.core.num_proposed_tokens > 0
    assert len(alone) == 10
    assert beside == alone
    assert speculating == [alone, alone]
    assert set(requests_per_graph) == {1}
