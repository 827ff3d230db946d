"""Speculative decoding in the engine: proposals change how many steps a request takes, never its tokens.

The tiny random model rarely repeats its prompt, so most tests force the proposals: an oracle that
knows a request's output from a run without speculation proposes it, with a wrong token in every
third proposal, so every step sees right, partly right and wrong guesses. The prompt-lookup
proposer itself is tested in test_prompt_lookup.py and, on the real model, in
tests/integration/test_default_model.py.

Logprobs (the sampled token's and the top-n) are compared bit for bit on engines that load the model
themselves, on the C kernels; a model handed to the engine (tiny_fp32) runs torch's linears, whose
float32 GEMM gives a verified row logprobs 1 ULP (~5e-7) off a one-row step's, as docs/ARCHITECTURE.md
says of every path without the C kernels.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency

from services.decoder.tests.engine.engine_helpers import finished as _finished
from services.decoder.tests.engine.engine_helpers import run_concurrently as _run_concurrently
from services.decoder.tests.engine.engine_helpers import tokens as _tokens
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.engine.sampling import prompt_lookup
from tandem.decoder.engine.step import runner
from tandem.decoder.models.loader import LoadedModel


def _engine(model_dir: Path, loaded: LoadedModel | None, **overrides) -> Engine:
    """An engine over `loaded` as given (torch ops), or, with None, over the model it loads itself: on
    the CPU executor, the kernels a served model runs (the float32 linears csrc/linear_f32.c's)."""
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=1024, block_size=4, max_num_seqs=16)
    # Every batch speculates unless a test says otherwise (the default stops above 4 requests).
    settings["speculative_max_batch"] = 64
    return Engine(EngineConfig(**(settings | overrides)), loaded)


def _logprobs(events: list[Event]) -> list:
    """Each token's logprob, then each token's top-n (IDs and logprobs), to compare bit for bit."""
    deltas = [e for e in events if isinstance(e, Delta)]
    return [lp for e in deltas for lp in e.logprobs] + [top for e in deltas for top in e.top_logprobs]


class Oracle:
    """Stands in for prompt lookup: proposes a request's known output, every third proposal with one
    token wrong. Requests are recognised by their prompt (embedding positions are holes in it)."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, ...], list[int]] = {}
        self.num_calls = 0

    def know(self, history_of_prompt: list[int], output: list[int]) -> None:
        self.outputs[tuple(history_of_prompt)] = output

    def propose(self, lookup: prompt_lookup.PromptLookup, max_tokens: int) -> list[int]:
        history = lookup.history
        for prompt, output in self.outputs.items():
            generated = history[len(prompt) :]
            if tuple(history[: len(prompt)]) == prompt and output[: len(generated)] == generated:
                guess = output[len(generated) : len(generated) + max_tokens]
                self.num_calls += 1
                if guess and self.num_calls % 3 == 0:
                    guess[self.num_calls % len(guess)] += 1
                return guess
        return []


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Iterator[Oracle]:
    oracle = Oracle()
    monkeypatch.setattr(prompt_lookup.PromptLookup, "propose", lambda self, k: oracle.propose(self, k))
    yield oracle


def _prompts(loaded: LoadedModel) -> dict[str, list]:
    ids = torch.randint(5, 1000, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = torch.randn(9, loaded.config.hidden_size, generator=torch.Generator().manual_seed(4))
    return {
        "tokens": [ids],
        "embeddings": [EmbeddingPrompt(rows)],
        "mixed": [ids[:5], EmbeddingPrompt(rows[:4]), ids[5:9]],
    }


def _history(loaded: LoadedModel, prompt: list) -> list[int]:
    """What PromptLookup's history holds for `prompt`: token IDs, -1 at embedding positions."""
    history = []
    for part in prompt:
        history.extend([-1] * part.rows.shape[0] if isinstance(part, EmbeddingPrompt) else part)
    return history


def _spec(prompt: list, sampling: SamplingParams, max_new_tokens: int = 24, **kw) -> GenerateSpec:
    stopping = StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return GenerateSpec(prompt=prompt, sampling=sampling, stopping=stopping, **kw)


def test_under_batch_invariant_speculation_gives_the_logprobs_of_plain_steps_bit_for_bit(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 linears are the C kernel's (csrc/linear_f32.c), which keeps a row's sums in one order
    at any row count, where MKL's blocked them by it (a verification's 5 rows gave its first row a
    logprob 1 ULP off a one-row step's): a verification runs in one pass, not row by row, and a
    speculating request's logprobs are those without speculation, alone and beside others."""

    def row_by_row(host: object) -> None:
        raise AssertionError("a verification ran row by row")

    monkeypatch.setattr(runner, "rows_apart", row_by_row)
    prompt = _prompts(tiny_fp32)["tokens"]
    sampling = SamplingParams(temperature=0.9, seed=11, logprobs=True, top_logprobs=3)
    with _engine(tiny_model_dir, None, batch_invariant=True) as engine:
        assert engine.executor.rows_exact
        plain = list(engine.generate(_spec(prompt, sampling)))
        oracle.know(_history(tiny_fp32, prompt), _tokens(plain))
        alone = list(engine.generate(_spec(prompt, sampling, speculative_tokens=4)))
        others = [_spec([[7 + i, 8, 9]], sampling, max_new_tokens=8) for i in range(2)]
        beside = _run_concurrently(engine, [_spec(prompt, sampling, speculative_tokens=4), *others])[0]
    for events in (alone, beside):
        assert _tokens(events) == _tokens(plain)
        assert _logprobs(events) == _logprobs(plain)  # exactly
        assert _finished(events).proposed_tokens > _finished(events).accepted_tokens > 0


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)]
)
def test_tokens_with_speculation_equal_those_without_alone_and_batched(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle, sampling: SamplingParams
) -> None:
    """Greedy and seeded requests, token, embedding and mixed prompts, alone and in a batch where
    some requests speculate and some do not: the same tokens, and the logprobs of plain steps bit for
    bit (a row's linears sum in one order at any row count; MKL's float32 GEMM gave them 1 ULP off)."""
    prompts = _prompts(tiny_fp32)
    sampling = SamplingParams(**{**sampling.__dict__, "logprobs": True, "top_logprobs": 3})
    with _engine(tiny_model_dir, None) as engine:
        plain = {kind: list(engine.generate(_spec(p, sampling))) for kind, p in prompts.items()}
    for kind, prompt in prompts.items():
        oracle.know(_history(tiny_fp32, prompt), _tokens(plain[kind]))

    with _engine(tiny_model_dir, None, speculative_tokens=4) as engine:
        alone = {kind: list(engine.generate(_spec(p, sampling))) for kind, p in prompts.items()}
        # Each prompt twice in one batch: once speculating, once with the request turning it off.
        specs = [_spec(p, sampling, speculative_tokens=k) for p in prompts.values() for k in (None, 0)]
        batched = _run_concurrently(engine, specs)

    for kind, events in alone.items():
        assert _tokens(events) == _tokens(plain[kind]), kind
        assert _logprobs(events) == _logprobs(plain[kind]), kind  # exactly
        finished = _finished(events)
        assert finished.output_tokens == 24
        assert finished.proposed_tokens > finished.accepted_tokens > 0, kind
    for events, kind in zip(batched, [k for k in prompts for _ in (None, 0)], strict=True):
        assert _tokens(events) == _tokens(plain[kind]), kind
        assert _logprobs(events) == _logprobs(plain[kind]), kind  # exactly
    assert [_finished(e).proposed_tokens > 0 for e in batched] == [True, False] * len(prompts)


def test_speculation_keeps_the_sampling_distribution(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling (temperature 1.5, top-k 3) over three tokens: the joint distribution of the tokens,
    with a fixed two-token proposal verified at the second step, matches the one without (a
    chi-square test of homogeneity, 1,200 requests each). Each request has a seed of its own, the two
    runs disjoint ones: independent samples, the same on every run whatever the batching, and a
    speculation that skewed the distribution would still show as a p-value far below the bound."""
    prompt = [torch.randint(5, 1000, (6,), generator=torch.Generator().manual_seed(8)).tolist()]

    def specs(first_seed: int) -> list[GenerateSpec]:
        return [
            _spec(prompt, SamplingParams(temperature=1.5, top_k=3, seed=first_seed + i), 3)
            for i in range(1200)
        ]

    config = dict(max_num_seqs=64, max_queue=4096)
    with _engine(tiny_model_dir, tiny_fp32, **config) as engine:
        greedy = _tokens(list(engine.generate(_spec(prompt, SamplingParams(temperature=0.0), 3))))
        plain = _run_concurrently(engine, specs(first_seed=0))
    # The proposal the greedy path would make: often right, often wrong, never the same as a sample.
    monkeypatch.setattr(
        prompt_lookup.PromptLookup, "propose", lambda self, k: greedy[1:3] if len(self.history) == 7 else []
    )
    with _engine(tiny_model_dir, tiny_fp32, speculative_tokens=2, **config) as engine:
        speculated = _run_concurrently(engine, specs(first_seed=1200))
    assert sum(_finished(e).accepted_tokens for e in speculated) > 100  # the proposal was often right

    plain_counts = Counter(tuple(_tokens(e)) for e in plain)
    spec_counts = Counter(tuple(_tokens(e)) for e in speculated)
    # Sequences seen at least 10 times in all; the rest pooled, so every expected count is large.
    common = [s for s in plain_counts | spec_counts if plain_counts[s] + spec_counts[s] >= 10]
    table = [[counts[s] for s in common] for counts in (plain_counts, spec_counts)]
    rest = [1200 - sum(row) for row in table]
    if any(rest):
        table = [row + [n] for row, n in zip(table, rest, strict=True)]
    assert len(common) >= 5  # it really sampled
    assert chi2_contingency(table).pvalue > 0.001


def test_a_seeded_request_gives_the_same_tokens_on_every_run(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    prompt = _prompts(tiny_fp32)["mixed"]
    sampling = SamplingParams(temperature=1.0, seed=5)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        plain = _tokens(list(engine.generate(_spec(prompt, sampling))))
    oracle.know(_history(tiny_fp32, prompt), plain)
    runs = []
    for _ in range(2):
        with _engine(tiny_model_dir, tiny_fp32, speculative_tokens=3) as engine:
            runs.append(_tokens(list(engine.generate(_spec(prompt, sampling)))))
    assert runs[0] == runs[1] == plain
    assert len(set(plain)) > 5


def test_a_proposal_never_outruns_max_new_tokens_or_the_context(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    prompt = _prompts(tiny_fp32)["tokens"]
    greedy = SamplingParams(temperature=0.0)
    with _engine(tiny_model_dir, tiny_fp32, max_model_len=30) as engine:
        plain = list(engine.generate(_spec(prompt, greedy, max_new_tokens=7)))
        to_context = list(engine.generate(_spec(prompt, greedy, max_new_tokens=16)))
    oracle.know(prompt[0], _tokens(to_context))
    with _engine(tiny_model_dir, tiny_fp32, max_model_len=30, speculative_tokens=8) as engine:
        capped = list(engine.generate(_spec(prompt, greedy, max_new_tokens=7)))
        full = list(engine.generate(_spec(prompt, greedy, max_new_tokens=16)))
    assert _tokens(capped) == _tokens(plain) and _finished(capped).output_tokens == 7
    assert _tokens(full) == _tokens(to_context)
    assert _finished(full).reason == _finished(to_context).reason
    assert _finished(full).accepted_tokens > 0


def test_speculative_tokens_out_of_range_is_invalid_argument(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        with pytest.raises(Exception, match=r"speculative_tokens.*\[0, 16\], got 17"):
            engine.make_request(_spec([[5, 6]], SamplingParams(), speculative_tokens=17))


def test_the_engine_counts_proposed_and_accepted_tokens(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    prompt = _prompts(tiny_fp32)["tokens"]
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        oracle.know(prompt[0], _tokens(list(engine.generate(_spec(prompt, SamplingParams(temperature=0.0))))))
    with _engine(tiny_model_dir, tiny_fp32, speculative_tokens=4) as engine:
        finished = _finished(list(engine.generate(_spec(prompt, SamplingParams(temperature=0.0)))))
        assert engine.core.num_proposed_tokens == finished.proposed_tokens
        assert engine.core.num_accepted_tokens == finished.accepted_tokens
        # 24 tokens in fewer steps than 24: every accepted token saved one.
        assert engine.core.num_steps == 24 - finished.accepted_tokens


def test_in_static_shape_mode_verifications_fit_the_warmed_buckets(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    """Each verified position is a padded sequence of its own: no new signature after warmup, the
    rows never outgrow the largest sequence bucket, and the tokens are the dynamic engine's."""
    prompts = _prompts(tiny_fp32)
    greedy = SamplingParams(temperature=0.0)
    sizes = dict(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=256)
    with _engine(tiny_model_dir, tiny_fp32, **sizes) as engine:
        plain = {kind: _tokens(list(engine.generate(_spec(p, greedy)))) for kind, p in prompts.items()}
    for kind, prompt in prompts.items():
        oracle.know(_history(tiny_fp32, prompt), plain[kind])
    with _engine(tiny_model_dir, tiny_fp32, static_shapes=True, speculative_tokens=6, **sizes) as engine:
        warmed = set(engine.core.runner.signatures)
        results = _run_concurrently(engine, [_spec(p, greedy) for p in prompts.values()])
        assert engine.core.runner.signatures == warmed
        assert engine.core.num_accepted_tokens > 0
    assert [_tokens(events) for events in results] == list(plain.values())


def test_a_speculating_request_scores_its_prompt_as_a_plain_one_does(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    """Prompt logprobs come from the prompt's own steps, speculation from the decode steps after:
    together, each is what it is alone."""
    prompt = _prompts(tiny_fp32)["mixed"]
    sampling = SamplingParams(temperature=0.0, prompt_logprobs=3)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        plain = list(engine.generate(_spec(prompt, sampling)))
    oracle.know(_history(tiny_fp32, prompt), _tokens(plain))
    with _engine(tiny_model_dir, tiny_fp32, speculative_tokens=4) as engine:
        speculated = list(engine.generate(_spec(prompt, sampling)))
    assert _tokens(speculated) == _tokens(plain)
    assert _finished(speculated).accepted_tokens > 0

    def scored(events: list[Event]) -> list:
        (first, *_) = [e for e in events if isinstance(e, Delta)]
        return [(p.token_id, p.top_token_ids) for p in first.prompt_logprobs]

    assert scored(speculated) == scored(plain)
    assert len(scored(plain)) == 13  # every prompt position


def test_a_batch_larger_than_speculative_max_batch_verifies_no_proposals(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    prompt = _prompts(tiny_fp32)["tokens"]
    greedy = SamplingParams(temperature=0.0)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        oracle.know(prompt[0], _tokens(list(engine.generate(_spec(prompt, greedy)))))
    for max_batch, speculates in ((4, False), (6, True)):
        config = dict(speculative_tokens=4, speculative_max_batch=max_batch)
        with _engine(tiny_model_dir, tiny_fp32, **config) as engine:
            results = _run_concurrently(engine, [_spec(prompt, greedy)] * 6)
        assert [_finished(e).proposed_tokens > 0 for e in results] == [speculates] * 6


def test_quantized_weights_turn_dense_only_past_the_largest_step_without_prompt_rows(
    tiny_model_dir: Path,
) -> None:
    # The CPU executor reads quantized weights as bf16 from dense_rows rows on (prefill speed); a
    # decode or verify step must never get there, or a row's sums would change with its step's size
    # and speculation would stop being exact. The engine derives the bound from its own limits.
    from tandem.decoder.config import MAX_SPECULATIVE_TOKENS

    for max_num_seqs, max_batch in ((16, 4), (200, 4), (8, 12)):
        config = EngineConfig(
            model_dir=tiny_model_dir,
            num_kv_blocks=64,
            max_num_seqs=max_num_seqs,
            speculative_max_batch=max_batch,
        )
        verify_rows = max_batch * (1 + MAX_SPECULATIVE_TOKENS)  # each verifying request: its row + k
        assert config.max_rows_without_prompt == max(max_num_seqs, verify_rows)
    from tandem.decoder.backends.cpu.kernels import load_for_cpu

    with Engine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=64)) as engine:
        # (Only builds with the packed bf16 kernel have the dense path: elsewhere every row is exact.)
        kernels = load_for_cpu()
        has_dense_path = kernels is not None and kernels.weight_layout != 0
        has_dense_path = has_dense_path and engine.config.dtype == "bfloat16"
        expected = engine.config.max_rows_without_prompt + 1 if has_dense_path else 0
        assert engine.executor.choice.dense_rows == expected


def test_with_int8_activations_speculation_and_batching_keep_each_requests_tokens(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    """--quantized-activations int8 rounds each row's inputs on its own and keeps one summation order
    per row: within the mode a request's tokens and logprobs are the same alone, batched, and with
    its proposals verified in the same step (the CPU executor's fused layers and decode stack)."""
    settings = dict(
        model_dir=tiny_model_dir, num_kv_blocks=1024, block_size=4, max_num_seqs=16, speculative_max_batch=64,
        quantization="int8",
    )  # fmt: skip
    prompts = _prompts(tiny_fp32)
    sampling = SamplingParams(temperature=0.0, logprobs=True)
    with Engine(EngineConfig(**settings)) as engine:
        exact = {kind: list(engine.generate(_spec(p, sampling))) for kind, p in prompts.items()}
    with Engine(EngineConfig(**settings, quantized_activations="int8")) as engine:
        assert engine.executor.choice.int8_activations
        plain = {kind: list(engine.generate(_spec(p, sampling))) for kind, p in prompts.items()}
    # The mode is on: the same weights give other numbers.
    assert any(_logprobs(plain[kind]) != _logprobs(exact[kind]) for kind in prompts)
    for kind, prompt in prompts.items():
        oracle.know(_history(tiny_fp32, prompt), _tokens(plain[kind]))

    with Engine(EngineConfig(**settings, quantized_activations="int8", speculative_tokens=4)) as engine:
        alone = {kind: list(engine.generate(_spec(p, sampling))) for kind, p in prompts.items()}
        specs = [_spec(p, sampling, speculative_tokens=k) for p in prompts.values() for k in (None, 0)]
        batched = _run_concurrently(engine, specs)
    for kind, events in alone.items():
        assert _tokens(events) == _tokens(plain[kind]), kind
        assert _logprobs(events) == _logprobs(plain[kind]), kind
        assert _finished(events).accepted_tokens > 0, kind
    for events, kind in zip(batched, [k for k in prompts for _ in (None, 0)], strict=True):
        assert _tokens(events) == _tokens(plain[kind]), kind
        assert _logprobs(events) == _logprobs(plain[kind]), kind


def test_beside_a_long_prompt_prefilling_in_chunks_speculation_gives_the_logprobs_of_plain_steps(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, oracle: Oracle
) -> None:
    """A neighbour's prompt chunks past the C kernel's prefill context (640) attend on SDPA; a decode
    or verification row sharing their step stays on the decode kernel (backends/cpu/attention.py), so
    a request's rows get the same bits whichever steps they land in: speculating beside the chunks,
    plain beside them and plain alone give one set of logprobs (on SDPA a row's were 1 ULP off)."""
    prompt = _prompts(tiny_fp32)["tokens"]
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    long_prompt = torch.randint(5, 1000, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    neighbour = _spec([long_prompt], SamplingParams(temperature=0.0), max_new_tokens=1)
    with _engine(tiny_model_dir, None, max_num_batched_tokens=64, enable_prefix_caching=False) as engine:
        alone = list(engine.generate(_spec(prompt, sampling)))
        oracle.know(prompt[0], _tokens(alone))
        beside = {
            k: _run_concurrently(engine, [_spec(prompt, sampling, speculative_tokens=k), neighbour])[0]
            for k in (0, 4)
        }
    assert _finished(beside[4]).accepted_tokens > 0
    for events in beside.values():
        assert _tokens(events) == _tokens(alone)
        assert _logprobs(events) == _logprobs(alone)  # exactly
