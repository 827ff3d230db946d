"""Prompt logprobs: which logits rows a step adds, how they are reduced and collected, and the result
end to end against transformers' log_softmax over the same inputs (`inputs_embeds` for embedding rows).

Tolerance: both sides compute in float32 on the same weights, so they differ only by the order of
float32 sums (a paged, chunked attention against one dense pass); 1e-4 in natural log is far below
any real difference (a wrong row or position moves a logprob by whole units on this model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event, Finished, OutputOptions
from tandem.decoder.engine.outputs.prompt_logprobs import (
    PromptLogprob,
    PromptLogprobsBuffer,
    PromptLogprobsChunk,
    ScoredSpan,
    score,
)
from tandem.decoder.engine.params import MAX_TOP_LOGPROBS, ParamError, SamplingParams, StoppingParams
from tandem.decoder.engine.request import Request, TokenSegment
from tandem.decoder.engine.scheduling.step_plan import ScheduledRequest, StepPlan
from tandem.decoder.engine.step.batch import BatchTensors, pack
from tandem.decoder.engine.step.static_shapes import StaticShapes, pad_to_buckets
from tandem.decoder.models.loader import LoadedModel

from ..front.test_engine import _run_concurrently

TOLERANCE = 1e-4
TOP_N = 5


# -- which rows a step adds (pack) ------------------------------------------------------------------


def _request(request_id: str, prompt: list[int], prompt_logprobs: int | None) -> Request:
    return Request.from_segments(
        request_id, [TokenSegment(prompt)], SamplingParams(prompt_logprobs=prompt_logprobs)
    )


def _item(request: Request, start: int, end: int) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request.request_id,
        request=request,
        start=start,
        num_new_tokens=end - start,
        block_ids=(1, 2, 3, 4),
        needs_logits=end == request.num_tokens,
        is_prefill=start < request.num_prompt_tokens,
    )


def _plan(*items: ScheduledRequest) -> StepPlan:
    return StepPlan(items, sum(i.num_new_tokens for i in items), (), 0)


def test_a_scoring_prefill_chunk_adds_one_row_per_position_that_scores_the_next_prompt_position() -> None:
    plain = _request("plain", [5, 6, 7], None)
    scoring = _request("scoring", [10, 11, 12, 13, 14, 15], 3)
    # plain's whole prompt (samples at packed 2), then scoring's positions 2..4 (packed 3..5).
    host = pack(_plan(_item(plain, 0, 3), _item(scoring, 2, 5)), block_size=4)
    assert host.logits_rows == [2]
    assert host.scored_rows == [3, 4, 5]  # positions 2, 3, 4 score positions 3, 4, 5
    assert host.scored_spans == [ScoredSpan("scoring", 3, (13, 14, 15), (True, True, True), 3)]


def test_the_last_prompt_position_only_samples_and_later_steps_score_nothing() -> None:
    scoring = _request("scoring", [10, 11, 12, 13], 0)
    last_chunk = pack(_plan(_item(scoring, 2, 4)), block_size=4)
    assert last_chunk.logits_rows == [1]  # position 3 predicts the first output token
    assert last_chunk.scored_rows == [0]  # position 2 scores position 3; position 3 scores nothing
    scoring.output_token_ids.append(99)  # the prompt's entries went out with this token
    recompute = pack(_plan(_item(scoring, 0, 5)), block_size=4)  # e.g. after a preemption
    assert recompute.scored_rows == [] and recompute.scored_spans == []


def test_requests_without_the_option_add_no_logits_rows() -> None:
    plain = _request("plain", list(range(10, 30)), None)
    host = pack(_plan(_item(plain, 0, 8)), block_size=4)
    assert host.logits_rows == [] and host.scored_rows == []
    batch = BatchTensors(torch.device("cpu"), 8, torch.float32).batch(host, 4, has_embeds=False)
    assert batch.inputs.attn.logits_indices.shape == (0,)


def test_scored_rows_come_after_the_sampled_rows_static_padding_included() -> None:
    plain = _request("plain", [5, 6, 7], None)
    scoring = _request("scoring", [10, 11, 12], 2)
    host = pack(_plan(_item(scoring, 0, 3), _item(plain, 0, 3)), block_size=4)
    static = StaticShapes(token_buckets=(8, 16), seq_buckets=(1, 2, 4), block_table_widths=(4,))
    pad_to_buckets(host, static, block_size=4)
    batch = BatchTensors(torch.device("cpu"), 8, torch.float32).batch(host, 4, has_embeds=True)
    num_seqs = len(host.query_lens)
    rows = batch.inputs.attn.logits_indices.tolist()
    assert rows[num_seqs:] == [0, 1]  # after num_seqs padded sampling rows
    assert batch.num_logits == 2 and batch.num_scored_rows == 2


def test_a_request_scoring_its_prompt_takes_no_prefix_cache_hit_until_it_has_delivered() -> None:
    from tandem.decoder.engine.scheduling.kv_cache import BlockManager

    manager = BlockManager(num_blocks=16, block_size=4)
    first = _request("first", list(range(10, 19)), None)
    assert manager.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    manager.cache_full_blocks(first)
    scoring = _request("scoring", list(range(10, 19)), 0)
    assert manager.get_computed_blocks(scoring) == ([], 0)
    scoring.output_token_ids.append(3)  # delivered: a recompute may use the cache again
    assert manager.get_computed_blocks(scoring)[1] == 8


def test_prompt_logprobs_beyond_the_limit_name_the_output_field() -> None:
    SamplingParams(prompt_logprobs=MAX_TOP_LOGPROBS).validate(vocab_size=100)
    with pytest.raises(ParamError) as caught:
        SamplingParams(prompt_logprobs=MAX_TOP_LOGPROBS + 1).validate(vocab_size=100)
    assert caught.value.field == "output.prompt_logprobs"


# -- reducing rows and collecting entries -----------------------------------------------------------


def test_score_gives_each_span_its_targets_logprob_and_top_n_and_none_at_embedding_rows() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    spans = [
        ScoredSpan("a", 1, (3, 0), (True, False), 2),
        ScoredSpan("b", 4, (7, 8, 9), (True, True, True), 0),
    ]
    a, b = score(lambda rows: logits[rows], spans, logits.device)
    expected = torch.log_softmax(logits, dim=-1)
    assert a.logprobs[0] == pytest.approx(expected[0, 3].item()) and a.logprobs[1] is None
    top = expected[1].topk(2)
    assert a.top_token_ids[1] == tuple(top.indices.tolist())
    assert a.top_logprobs[1] == pytest.approx(top.values.tolist())
    assert b.logprobs == pytest.approx([expected[2 + k, t].item() for k, t in enumerate((7, 8, 9))])
    assert b.top_token_ids == ((), (), ()) and (a.start, b.start) == (1, 4)


def test_score_reduces_in_slices_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(1))
    spans = [ScoredSpan("a", 1, (1, 2, 3, 4, 5, 6, 7), (True,) * 7, 3)]
    asked: list[slice] = []

    def logits_of(rows: slice) -> torch.Tensor:
        asked.append(rows)
        return logits[rows]

    whole = score(logits_of, spans, logits.device)
    monkeypatch.setattr("tandem.decoder.engine.outputs.prompt_logprobs.SLICE_ROWS", 2)
    assert score(logits_of, spans, logits.device) == whole
    assert asked == [slice(0, 7), slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]


def _brute_force_rank(row: torch.Tensor, token_id: int) -> int:
    """One more than the tokens strictly likelier than `token_id` in one row of logits, counted one
    by one over that row's own log-softmax."""
    logprobs = torch.log_softmax(row, dim=-1).tolist()
    return 1 + sum(1 for value in logprobs if value > logprobs[token_id])


def test_score_ranks_each_token_over_the_whole_vocabulary_inside_the_top_n_or_not() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    logits[0, 7] = logits[0].max() + 1  # the likeliest: rank 1
    logits[1, 7] = logits[1].min() - 1  # the least likely: rank 50
    logits[2, [7, 8, 9]] = logits[2].max() + 1  # tied first: none strictly likelier, rank 1
    spans = [ScoredSpan("a", 1, (7, 7, 7, 3, 4, 0), (True,) * 5 + (False,), 2)]
    (chunk,) = score(lambda rows: logits[rows], spans, logits.device)
    expected = [_brute_force_rank(logits[k], t) for k, t in enumerate(spans[0].target_ids[:5])]
    assert chunk.ranks == (*expected, None)  # an embedding row has no token to rank
    assert chunk.ranks[:3] == (1, 50, 1)
    assert any(rank > 2 for rank in expected[3:]), "a token outside the top 2 is ranked as well"


def test_a_rows_rank_is_the_same_scored_alone_and_among_others() -> None:
    logits = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    targets = (5, 17, 33, 2, 60, 41, 8, 19, 27)
    together = score(lambda rows: logits[rows], [ScoredSpan("a", 1, targets, (True,) * 9, 3)], logits.device)
    alone = [
        score(
            lambda rows, k=k: logits[k : k + 1][rows], [ScoredSpan("a", 1, (t,), (True,), 3)], logits.device
        )
        for k, t in enumerate(targets)
    ]
    assert together[0].ranks == tuple(chunk.ranks[0] for (chunk,) in alone)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_score_names_a_spans_first_non_finite_position_and_leaves_the_other_spans_alone(bad: float) -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    spans = [ScoredSpan("a", 1, (1, 2, 3), (True,) * 3, 2), ScoredSpan("b", 5, (4, 5, 6), (True,) * 3, 2)]
    healthy_a, healthy_b = score(lambda rows: logits[rows], spans, logits.device)
    faulty = logits.clone()
    faulty[4, 9] = bad  # b's second row: the logits scoring its position 6
    faulty[5] = float("-inf")  # and its third, all -inf
    a, b = score(lambda rows: faulty[rows], spans, logits.device)
    assert (healthy_a.first_non_finite, healthy_b.first_non_finite) == (None, None)
    assert a == healthy_a
    assert b.first_non_finite == 6


def test_the_buffer_marks_position_0_keeps_the_first_result_and_is_complete_only_when_whole() -> None:
    buffer = PromptLogprobsBuffer([0, 11, 12], [False, True, True])  # an embedding row, then tokens
    buffer.add(PromptLogprobsChunk("r", 1, (-1.0,), ((11,),), ((-1.0,),), (1,)))
    assert not buffer.is_complete
    with pytest.raises(RuntimeError):
        buffer.entries()
    recompute = PromptLogprobsChunk("r", 1, (-9.0, -2.0), ((5,), (12,)), ((-0.5,), (-2.0,)), (9, 1))
    buffer.add(recompute)
    assert buffer.entries() == (
        PromptLogprob(None, None, (), ()),
        PromptLogprob(11, -1.0, (11,), (-1.0,), rank=1),
        PromptLogprob(12, -2.0, (12,), (-2.0,), rank=1),
    )


# -- end to end against transformers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train(False)


def _engine(model_dir: Path, loaded: LoadedModel, **overrides) -> Engine:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=256, block_size=4, max_num_seqs=8)
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded)


def _spec(prompt: list, top_n: int = TOP_N, request_id: str = "") -> GenerateSpec:
    return GenerateSpec(
        prompt,
        SamplingParams(temperature=0.0, prompt_logprobs=top_n),
        StoppingParams(max_new_tokens=3, ignore_eos=True),
        request_id=request_id,
    )


def _prompt_logprobs(events: list[Event]) -> tuple[PromptLogprob, ...]:
    deltas = [e for e in events if isinstance(e, Delta)]
    assert all(not d.prompt_logprobs for d in deltas[1:]), "only the first delta carries them"
    return deltas[0].prompt_logprobs


def _expected(reference, loaded: LoadedModel, prompt: list) -> tuple[list[int | None], torch.Tensor]:
    """Token per position (None at embedding rows) and transformers' log_softmax [positions, vocab]."""
    table = reference.get_input_embeddings().weight
    rows, token_ids = [], []
    for part in prompt:
        if isinstance(part, EmbeddingPrompt):
            rows.append(part.rows.to(torch.float32))
            token_ids += [None] * part.rows.shape[0]
        else:
            rows.append(table[part])
            token_ids += list(part)
    with torch.no_grad():
        logits = reference(inputs_embeds=torch.cat(rows)[None]).logits[0]  # [positions, vocab]
    return token_ids, torch.log_softmax(logits.float(), dim=-1)


def _assert_matches(entries: tuple[PromptLogprob, ...], token_ids: list[int | None], logprobs: torch.Tensor):
    assert len(entries) == len(token_ids)
    assert entries[0] == PromptLogprob(token_ids[0], None, (), ())
    for p in range(1, len(entries)):
        entry, row = entries[p], logprobs[p - 1]  # position p given positions 0 .. p - 1
        assert entry.token_id == token_ids[p]
        if token_ids[p] is None:
            assert entry.logprob is None and entry.rank is None
        else:
            assert entry.logprob == pytest.approx(row[token_ids[p]].item(), abs=TOLERANCE)
            # Counted over the reference's row: a token within TOLERANCE of the target may fall either way.
            own = row[token_ids[p]]
            assert (
                1 + (row > own + TOLERANCE).sum().item()
                <= entry.rank
                <= 1 + (row > own - TOLERANCE).sum().item()
            )
        top = row.topk(TOP_N)
        assert entry.top_token_ids == tuple(top.indices.tolist()), p
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def _prompts(loaded: LoadedModel) -> dict[str, list]:
    gen = torch.Generator().manual_seed(5)
    hidden = loaded.config.hidden_size

    def ids(n: int) -> list[int]:
        return torch.randint(5, 400, (n,), generator=gen).tolist()

    def rows(n: int) -> EmbeddingPrompt:
        return EmbeddingPrompt(torch.randn(n, hidden, generator=gen) * 0.05)

    return {
        "tokens": [ids(23)],
        "embeddings": [rows(9)],
        "mixed": [ids(4), rows(5), ids(7), rows(2), ids(3)],
    }


@pytest.mark.parametrize("kind", ["tokens", "embeddings", "mixed"])
@pytest.mark.parametrize("budget", [2048, 5])
def test_prompt_logprobs_equal_transformers_log_softmax(
    tiny_model_dir, tiny_fp32, reference, kind: str, budget: int
) -> None:
    prompt = _prompts(tiny_fp32)[kind]
    with _engine(tiny_model_dir, tiny_fp32, max_num_batched_tokens=budget) as engine:
        steps_before = engine.core.num_steps
        events = list(engine.generate(_spec(prompt)))
        num_steps = engine.core.num_steps - steps_before
    token_ids, logprobs = _expected(reference, tiny_fp32, prompt)
    entries = _prompt_logprobs(events)
    _assert_matches(entries, token_ids, logprobs)
    if kind != "embeddings":  # ranked over the whole vocabulary, not only among the top TOP_N
        assert any(e.rank is not None and e.rank > TOP_N for e in entries)
    if budget == 5:  # the prompt ran in chunks of at most 5 positions
        assert num_steps >= len(token_ids) // 5


def test_a_cached_prompt_is_scored_in_full_and_its_blocks_still_serve_later_requests(
    tiny_model_dir, tiny_fp32, reference
) -> None:
    prompt = _prompts(tiny_fp32)["mixed"]
    plain = GenerateSpec(prompt, SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=3))
    token_ids, logprobs = _expected(reference, tiny_fp32, prompt)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        first = list(engine.generate(_spec(prompt)))  # fills the cache
        second = list(engine.generate(_spec(prompt)))  # its prefix is cached: it recomputes
        after = list(engine.generate(plain))
    for events in (first, second):
        _assert_matches(_prompt_logprobs(events), token_ids, logprobs)
        assert _finished(events).cached_tokens == 0
    assert _finished(after).cached_tokens == 20  # 5 full blocks of 4 of the 21 positions


def _finished(events: list[Event]) -> Finished:
    assert isinstance(events[-1], Finished)
    return events[-1]


def test_preempted_mid_prompt_each_position_is_sent_once_and_right(tiny_model_dir, tiny_fp32, reference):
    # 4 requests of 30 + 24 positions need 56 blocks of 4 and the pool has 31: with chunked
    # prefills (8 positions a step), the earlier requests' decodes preempt the last one mid-prompt.
    gen = torch.Generator().manual_seed(6)
    prompts = [[torch.randint(5, 400, (30,), generator=gen).tolist()] for _ in range(4)]
    specs = [
        GenerateSpec(
            p,
            SamplingParams(temperature=0.0, prompt_logprobs=TOP_N),
            StoppingParams(max_new_tokens=24, ignore_eos=True),
            request_id=f"r{i}",
        )
        for i, p in enumerate(prompts)
    ]
    with _engine(
        tiny_model_dir, tiny_fp32, num_kv_blocks=32, max_num_batched_tokens=8, enable_prefix_caching=False
    ) as engine:
        results = _run_concurrently(engine, specs)
    timelines = [[t.name for t in _finished(events).timeline] for events in results]
    assert any("preempted" in names[: names.index("first_token")] for names in timelines)
    for prompt, events in zip(prompts, results, strict=True):
        _assert_matches(_prompt_logprobs(events), *_expected(reference, tiny_fp32, prompt))


@pytest.mark.parametrize("mode", ["static_shapes", "batch_invariant"])
def test_scoring_requests_batched_with_others_match_alone_in_static_and_batch_invariant_modes(
    tiny_model_dir, tiny_fp32, reference, mode: str
) -> None:
    prompts = _prompts(tiny_fp32)
    specs = [_spec(prompts["mixed"], request_id="scored")] + [
        GenerateSpec(
            [[7 + i, 8, 9, 10, 11]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=4)
        )
        for i in range(3)
    ]
    settings = dict(max_num_batched_tokens=16, max_model_len=128, **{mode: True})
    with _engine(tiny_model_dir, tiny_fp32, **settings) as engine:
        warmed = set(engine.core.runner.signatures)
        alone = _prompt_logprobs(list(engine.generate(specs[0])))
        together = _run_concurrently(engine, specs)
        if mode == "static_shapes":
            assert engine.core.runner.signatures == warmed
    _assert_matches(alone, *_expected(reference, tiny_fp32, prompts["mixed"]))
    if mode == "batch_invariant":
        assert _prompt_logprobs(together[0]) == alone
    else:
        _assert_matches(_prompt_logprobs(together[0]), *_expected(reference, tiny_fp32, prompts["mixed"]))
    assert all(not d.prompt_logprobs for events in together[1:] for d in events if isinstance(d, Delta))


def test_a_one_position_prompt_gets_its_one_context_free_entry(tiny_model_dir, tiny_fp32) -> None:
    row = EmbeddingPrompt(torch.zeros(1, tiny_fp32.config.hidden_size))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        token = _prompt_logprobs(list(engine.generate(_spec([[42]]))))
        embedding = _prompt_logprobs(list(engine.generate(_spec([row]))))
    assert token == (PromptLogprob(42, None, (), ()),)
    assert embedding == (PromptLogprob(None, None, (), ()),)


def test_coalesced_deltas_carry_the_entries_once_on_the_first(tiny_model_dir, tiny_fp32, reference) -> None:
    prompt = _prompts(tiny_fp32)["tokens"]
    spec = _spec(prompt)
    spec = GenerateSpec(spec.prompt, spec.sampling, spec.stopping, OutputOptions(stream_interval=2))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        events = list(engine.generate(spec))
    assert [len(e.token_ids) for e in events if isinstance(e, Delta)] == [2, 1]
    _assert_matches(_prompt_logprobs(events), *_expected(reference, tiny_fp32, prompt))


def test_asking_for_prompt_logprobs_leaves_the_generated_tokens_and_their_logprobs_as_they_were(
    tiny_model_dir, tiny_fp32
) -> None:
    # On one rank the sampled rows go through the head on their own, as in a step that scores nothing.
    prompt = _prompts(tiny_fp32)["mixed"]
    sampling = SamplingParams(temperature=0.8, seed=3, logprobs=True)
    stopping = StoppingParams(max_new_tokens=6, ignore_eos=True)
    plain = GenerateSpec(prompt, sampling, stopping)
    scoring = GenerateSpec(prompt, dataclasses.replace(sampling, prompt_logprobs=TOP_N), stopping)
    with _engine(tiny_model_dir, tiny_fp32, enable_prefix_caching=False, max_num_batched_tokens=8) as engine:
        outputs = [
            [(d.token_ids, d.logprobs) for d in engine.generate(spec) if isinstance(d, Delta)]
            for spec in (plain, scoring)
        ]
    assert outputs[0] == outputs[1]
