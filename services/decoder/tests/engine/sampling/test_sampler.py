"""Sampler behaviour, checked against torch reference computations on small vocabularies."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.decoder.engine.params import MIN_REPETITION_PENALTY, MIN_SAMPLING_TEMPERATURE, SamplingParams
from tandem.decoder.engine.request import EmbeddingSegment, Request, TokenSegment
from tandem.decoder.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_min_p,
    apply_penalties_,
    apply_top_k_top_p,
    count_tokens,
)

VOCAB = 32


def make_batch(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    vocab_size: int = VOCAB,
) -> SamplingBatch:
    prompts = prompts or [[] for _ in params]
    return SamplingBatch.build(
        params,
        generators or [None] * len(params),
        prompts,
        [[True] * len(p) for p in prompts],
        vocab_size,
    )


def distinct_logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Logits a whole unit apart, so the argmax is unambiguous and tiny temperatures are deterministic."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() for _ in range(batch)])  # [batch, vocab]


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kwargs) -> torch.Tensor:
    batch = make_batch(params, vocab_size=logits.shape[-1])
    out = Sampler(torch.Generator().manual_seed(seed))(logits, batch, [[] for _ in params], **kwargs)
    return out.token_ids


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(8, VOCAB)
    assert torch.equal(sample(logits, [SamplingParams(temperature=0.0)] * 8), logits.argmax(-1))


def test_greedy_rows_take_the_executors_argmax_when_given_one() -> None:
    # The engine hands the sampler its executor's argmax (a C one on CPU): every greedy pick goes
    # through it, on the fast path and after penalties alike.
    calls = []

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return logits.argmin(dim=-1)  # visibly not torch's argmax

    logits = distinct_logits(4)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=0.5)):
        out = Sampler(argmax=argmax)(logits, make_batch([params] * 4), [[] for _ in range(4)])
        assert torch.equal(out.token_ids, logits.argmin(dim=-1))
    assert calls == [(4, VOCAB), (4, VOCAB)]


def test_greedy_rows_stay_argmax_next_to_sampling_rows() -> None:
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.5) for r in range(6)]
    token_ids = sample(logits, params)
    assert torch.equal(token_ids[1::2], logits[1::2].argmax(-1))


def test_tiny_temperature_behaves_like_greedy() -> None:
    logits = distinct_logits(16)
    assert torch.equal(sample(logits, [SamplingParams(temperature=1e-3)] * 16), logits.argmax(-1))


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(16, VOCAB)
    assert torch.equal(sample(logits, [SamplingParams(top_k=1)] * 16), logits.argmax(-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = torch.randn(16, VOCAB)
    assert torch.equal(sample(logits, [SamplingParams(top_p=1e-6)] * 16), logits.argmax(-1))


def test_top_k_never_samples_outside_the_k_most_likely() -> None:
    logits = torch.randn(1, VOCAB).expand(2000, VOCAB)
    token_ids = sample(logits, [SamplingParams(top_k=3)] * 2000)
    assert set(token_ids.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = apply_top_k_top_p(logits, top_k=None, top_p=torch.tensor([0.7]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]
    assert torch.equal(kept[0, :2], logits[0, :2])


def test_min_p_masks_tokens_below_a_fraction_of_the_top_prob() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = apply_min_p(logits, torch.tensor([0.25]))  # threshold 0.125
    assert torch.isfinite(kept[0]).tolist() == [True, True, True, False]
    token_ids = sample(logits.expand(2000, 4), [SamplingParams(min_p=0.5)] * 2000)  # threshold 0.25
    assert set(token_ids.tolist()) == {0, 1}


def test_penalties_follow_ctrl_and_openai_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # token 0 is in the prompt only; token 1 is output twice; token 3 once; 2 and 4 are unseen.
    apply_penalties_(
        logits,
        count_tokens([[1, 3, 1]], 5, "cpu"),
        count_tokens([[0]], 5, "cpu") > 0,
        repetition_penalty=torch.tensor([2.0]),
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
    )
    expected = [
        2.0 / 2.0,  # positive, seen in the prompt: divided; no presence/frequency for prompt tokens
        -1.0 * 2.0 - 0.25 * 2 - 0.5,  # negative, output twice: multiplied, then both penalties
        0.5,
        3.0 / 2.0 - 0.25 * 1 - 0.5,
        -2.0,
    ]
    torch.testing.assert_close(logits[0], torch.tensor(expected))


def test_sampler_reports_penalised_logits_as_logprobs() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, top_logprobs=5
    )
    batch = make_batch([params], prompts=[[0]], vocab_size=5)
    out = Sampler()(logits, batch, output_token_ids=[[1, 3, 1]])
    expected = torch.tensor([1.0, -3.0, 0.5, 0.75, -2.0]).log_softmax(-1)
    assert out.token_ids.tolist() == [0]  # the penalty moved the argmax from token 3 to token 0
    torch.testing.assert_close(out.top_logprobs[0], expected.sort(descending=True).values)


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = torch.randn(64, VOCAB)
    assert sample(logits, [SamplingParams(logit_bias={7: 100.0})] * 64).eq(7).all()
    argmax = int(logits[0].argmax())
    greedy = SamplingParams(temperature=0.0, logit_bias={argmax: -100.0})
    assert sample(logits[:1], [greedy]).item() != argmax


def test_min_tokens_mask_forbids_the_given_ids() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 50.0  # an EOS the model is sure about
    params = [SamplingParams(temperature=0.0), SamplingParams()]
    token_ids = sample(logits, params, min_tokens_mask_ids=[[5], [5]])
    assert 5 not in token_ids.tolist()
    assert sample(logits, params, min_tokens_mask_ids=[[], []]).tolist() == [5, 5]


def test_where_the_grammar_allows_only_banned_ids_the_grammar_wins_in_that_row_alone() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 50.0  # an EOS the model is sure about, banned by min_new_tokens in every row
    only_eos = torch.zeros(VOCAB, dtype=torch.bool)
    only_eos[5] = True  # the grammar can only end here
    eos_or_seven = only_eos.clone()
    eos_or_seven[7] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1), SamplingParams()]
    token_ids = sample(logits, params, min_tokens_mask_ids=[[5]] * 3, allowed=[only_eos, eos_or_seven, None])
    assert token_ids[:2].tolist() == [5, 7]  # lifted where it was all the grammar had; kept beside 7
    assert token_ids[2].item() != 5  # no grammar: the ban stands


def run_seeded_request(row: int, neighbours: list[SamplingParams], num_steps: int = 30) -> list[int]:
    """Sample the seeded request at `row` among `neighbours`; its logits are the same at every step."""
    request = SamplingParams(temperature=1.3, top_p=0.9, seed=1234)
    params = neighbours[:row] + [request] + neighbours[row:]
    generators = [None] * len(params)
    generators[row] = torch.Generator().manual_seed(request.seed)
    for r, p in enumerate(params):
        if p.seed is not None and r != row:
            generators[r] = torch.Generator().manual_seed(p.seed)
    batch = make_batch(params, generators)
    sampler = Sampler(torch.Generator().manual_seed(row))  # neighbours' shared noise differs per run
    request_logits = torch.Generator().manual_seed(99)
    token_ids = []
    for _ in range(num_steps):
        logits = torch.randn(len(params), VOCAB)
        logits[row] = torch.randn(VOCAB, generator=request_logits)
        token_ids.append(int(sampler(logits, batch, [[] for _ in params]).token_ids[row]))
    return token_ids


def test_seeded_row_samples_the_same_tokens_in_any_row_with_any_neighbours() -> None:
    alone = run_seeded_request(0, [])
    first = run_seeded_request(0, [SamplingParams(), SamplingParams(temperature=0.0)])
    last = run_seeded_request(3, [SamplingParams(top_k=4), SamplingParams(seed=7), SamplingParams()])
    assert alone == first == last
    assert len(set(alone)) > 5  # it really sampled, rather than collapsing to one token


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_unseeded_sampling_matches_the_softmax_distribution(temperature: float) -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    num_samples = 20_000
    logits = probs.log().expand(num_samples, -1)
    token_ids = sample(logits, [SamplingParams(temperature=temperature)] * num_samples)
    observed = torch.bincount(token_ids, minlength=len(probs)).double()
    expected = (probs.log() / temperature).softmax(-1).double() * num_samples
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 22.46  # the 0.999 quantile for 6 degrees of freedom; the seed is fixed


def test_logprobs_are_log_softmax_of_temperature_scaled_logits() -> None:
    logits = torch.randn(4, VOCAB)
    params = [
        SamplingParams(temperature=0.7, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=True),
    ] * 2
    out = Sampler(torch.Generator().manual_seed(0))(logits, make_batch(params), [[]] * 4)
    scaled = logits / torch.tensor([0.7, 1.0, 0.7, 1.0])[:, None]
    expected = scaled.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_token_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_top_logprobs_are_the_n_largest_sorted_descending(temperature: float) -> None:
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=temperature, top_logprobs=n) for n in (20, 2, 0)]
    out = Sampler()(logits, make_batch(params), [[]] * 3)
    reference = (logits / (temperature or 1.0)).log_softmax(-1)
    assert out.top_logprobs.shape == out.top_token_ids.shape == (3, 20)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    torch.testing.assert_close(out.top_logprobs, reference.gather(1, out.top_token_ids))
    torch.testing.assert_close(out.top_logprobs, reference.topk(20, dim=-1).values)
    assert math.isfinite(float(out.logprobs.sum()))


def test_equal_logprobs_are_listed_lowest_id_first_so_a_greedy_token_leads_its_equals() -> None:
    # argmax takes the first maximum; topk ordered and picked among equals its own way, so a greedy
    # answer's token came after an equally likely one in its own top list, or was missing from a top 1.
    logits = torch.full((2, VOCAB), -5.0)
    logits[0, [20, 7, 30]] = 3.0  # three equals on top
    logits[1, [15, 25]] = 3.0
    logits[1, [9, 29, 12]] = 1.0  # equals at the cut of a top 4: the lowest ids get in
    params = [SamplingParams(temperature=0.0, top_logprobs=n) for n in (1, 4)]
    out = Sampler()(logits, make_batch(params), [[]] * 2)
    assert out.token_ids.tolist() == [7, 15]
    assert out.top_token_ids[1].tolist() == [15, 25, 9, 12]
    assert out.top_token_ids[0, :3].tolist() == [7, 20, 30]  # (the row asked for 1: the rest is the batch's)
    assert out.top_token_ids[0, 0] == out.token_ids[0]


def test_all_greedy_batch_without_logprobs_returns_no_logprobs() -> None:
    out = Sampler()(torch.randn(2, VOCAB), make_batch([SamplingParams(temperature=0.0)] * 2), [[], []])
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


# The smallest positive values a caller can send: float32 on the wire, float64 in process.
FLOAT32_MIN_POSITIVE = float(torch.tensor(0.0).nextafter(torch.tensor(1.0)))  # 1.4e-45, subnormal
FLOAT64_MIN_POSITIVE = math.ulp(0.0)  # 5e-324


def sample_with_logprobs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplerOutput:
    batch = make_batch(params, prompts=prompts, vocab_size=logits.shape[-1])
    return Sampler(torch.Generator().manual_seed(0))(logits, batch, outputs or [[] for _ in params])


@pytest.mark.parametrize("temperature", [1e-45, FLOAT32_MIN_POSITIVE, FLOAT64_MIN_POSITIVE, 1e-38, 9.9e-6])
def test_a_temperature_below_the_floor_is_greedy_with_finite_logprobs(temperature: float) -> None:
    logits = torch.randn(4, VOCAB) * 5
    tiny = sample_with_logprobs(logits, [SamplingParams(temperature=temperature, top_logprobs=5)] * 4)
    greedy = sample_with_logprobs(logits, [SamplingParams(temperature=0.0, top_logprobs=5)] * 4)
    assert torch.equal(tiny.token_ids, logits.argmax(-1))
    assert torch.isfinite(tiny.logprobs).all() and torch.isfinite(tiny.top_logprobs).all()
    torch.testing.assert_close(tiny.logprobs, greedy.logprobs)
    torch.testing.assert_close(tiny.top_logprobs, greedy.top_logprobs)


def test_the_temperature_floor_itself_samples_with_finite_logprobs() -> None:
    logits = distinct_logits(8)
    params = [SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE, top_logprobs=5)] * 8
    out = sample_with_logprobs(logits, params)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.isfinite(out.top_logprobs).all()
    torch.testing.assert_close(out.logprobs, torch.zeros(8))  # a gap of 1 is 1e5 at this temperature


@pytest.mark.parametrize("penalty", [1e-45, FLOAT32_MIN_POSITIVE, FLOAT64_MIN_POSITIVE, 1e-38])
@pytest.mark.parametrize("temperature", [0.0, MIN_SAMPLING_TEMPERATURE, 1.0])
def test_a_repetition_penalty_below_the_floor_acts_as_the_floor(penalty: float, temperature: float) -> None:
    logits = torch.randn(4, VOCAB) * 5
    logits[:, 3] = 0.5  # the one seen token with a positive logit: the tiny penalty makes it win
    logits[:, [9, 11]] = -1.0
    prompts, outputs = [[3, 9]] * 4, [[9, 11, 9]] * 4

    def params(p: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=temperature, repetition_penalty=p, top_logprobs=5)] * 4

    tiny = sample_with_logprobs(logits, params(penalty), prompts, outputs)
    floor = sample_with_logprobs(logits, params(MIN_REPETITION_PENALTY), prompts, outputs)
    assert tiny.token_ids.eq(3).all()
    assert torch.isfinite(tiny.logprobs).all() and torch.isfinite(tiny.top_logprobs).all()
    torch.testing.assert_close(tiny.logprobs, floor.logprobs)
    torch.testing.assert_close(tiny.top_logprobs, floor.top_logprobs)


def edge_floats(low: float, high: float, *inside: float) -> st.SearchStrategy[float]:
    """Floats in [low, high], with the bounds and the given values (tiny ones, mostly) drawn often."""
    return st.one_of(st.sampled_from([low, high, *inside]), st.floats(low, high, allow_subnormal=True))


TINY = (1e-45, FLOAT32_MIN_POSITIVE, FLOAT64_MIN_POSITIVE, MIN_SAMPLING_TEMPERATURE)
VALID_PARAMS = st.builds(
    SamplingParams,
    temperature=edge_floats(0.0, 100.0, *TINY),
    top_p=edge_floats(FLOAT64_MIN_POSITIVE, 1.0, *TINY[:3]),
    top_k=st.integers(0, VOCAB + 1),
    min_p=edge_floats(0.0, 1.0, *TINY),
    repetition_penalty=edge_floats(FLOAT64_MIN_POSITIVE, 10.0, *TINY, 1.0),
    presence_penalty=edge_floats(-2.0, 2.0, *TINY, 0.0),
    frequency_penalty=edge_floats(-2.0, 2.0, *TINY, 0.0),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), edge_floats(-100.0, 100.0, *TINY), max_size=4),
    top_logprobs=st.just(5),
)


@settings(max_examples=300, deadline=None)
@given(params=st.lists(VALID_PARAMS, min_size=1, max_size=3), logit_scale=edge_floats(0.0, 30.0, 1.0))
def test_every_value_inside_the_documented_ranges_gives_a_token_and_finite_logprobs(
    params: list[SamplingParams], logit_scale: float
) -> None:
    for p in params:
        p.validate(VOCAB)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0)) * logit_scale
    prompts, outputs = [[3, 9, 9]] * len(params), [[9, 11, 4, 11]] * len(params)
    out = sample_with_logprobs(logits, params, prompts, outputs)
    assert ((out.token_ids >= 0) & (out.token_ids < VOCAB)).all()
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs).all()


def test_embedding_positions_are_not_prompt_tokens_for_the_repetition_penalty() -> None:
    # Embedding positions carry the placeholder ID 0; here token 0 is the argmax and never a prompt token.
    request = Request.from_segments(
        "r", [EmbeddingSegment(rows=None, num_rows=2, digests=[b"a", b"b"]), TokenSegment([1, 5])]
    )
    assert request.prompt_token_ids == [0, 0, 1, 5]
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    batch = SamplingBatch.build(params, [None], [request.prompt_token_ids], [request.is_token_ids], 6)
    assert batch.is_prompt_token[0].tolist() == [False, True, False, False, False, True]
    logits = torch.tensor([[2.0, 3.0, 1.5, 0.0, 0.0, 0.0]])  # token 1, the prompt token, is penalised to 1.5
    assert Sampler()(logits, batch, [[]]).token_ids.tolist() == [0]


def test_is_token_ids_must_cover_every_prompt_position() -> None:
    params = [SamplingParams(repetition_penalty=2.0)]
    with pytest.raises(ValueError, match="is_token_ids has 1 entries for a prompt of 2"):
        SamplingBatch.build(params, [None], [[1, 5]], [[True]], VOCAB)
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build(params, [None], [[1, 5]], [], VOCAB)


def _non_finite_rows() -> torch.Tensor:
    """Rows a faulty model gives: one NaN, one +inf, all -inf, all NaN. [4, VOCAB]."""
    rows = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    rows[0, 7] = float("nan")
    rows[1, 3] = float("inf")
    rows[2] = float("-inf")
    rows[3] = float("nan")
    return rows


@pytest.mark.parametrize(
    "params, kwargs",
    [
        ([SamplingParams(temperature=0.0)] * 2, {}),  # the greedy fast path: no copy, no softmax
        ([SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)] * 2, {}),
        ([SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=0.0)], {}),
        (
            [SamplingParams(temperature=0.7, top_k=5, seed=4, repetition_penalty=1.2)] * 2,
            {"allowed": [torch.arange(VOCAB) % 2 == 0] * 2},  # a grammar allowing even tokens
        ),
    ],
)
def test_a_row_of_non_finite_logits_is_flagged_and_its_neighbours_tokens_stay_the_same(
    params: list[SamplingParams], kwargs: dict
) -> None:
    """Each faulty row beside a healthy one: the faulty row is flagged, the healthy one's token and
    logprobs are those it gets beside another healthy row; a row of -inf entries among finite ones
    (a model that rules tokens out) is healthy."""
    healthy = distinct_logits(2, seed=9)
    healthy[1, :4] = float("-inf")

    def run(logits: torch.Tensor) -> SamplerOutput:
        generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        batch = make_batch(params, generators, prompts=[[1, 2], [2, 3]])
        allowed = kwargs.get("allowed")
        return Sampler(torch.Generator().manual_seed(0))(logits, batch, [[4], [5]], allowed=allowed)

    reference = run(healthy)
    assert reference.is_finite.tolist() == [True, True]
    for faulty in _non_finite_rows():
        out = run(torch.stack([faulty, healthy[1]]))
        assert out.is_finite.tolist() == [False, True]
        assert out.token_ids[1] == reference.token_ids[1]
        if reference.logprobs is not None:
            assert out.logprobs[1] == reference.logprobs[1]
            assert torch.equal(out.top_token_ids[1], reference.top_token_ids[1])
